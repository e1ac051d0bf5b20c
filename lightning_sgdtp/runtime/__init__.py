"""A job's processes: how they start and meet (rendezvous, launch), fail (the fault guard: any error on any rank ends
every rank in seconds, named), are preempted (SIGUSR1/SIGTERM, requeue) and end."""

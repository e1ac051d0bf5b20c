"""What the plugin shows the user: the plan dict and its ``sgdtp:`` lines, the step timeline, ``sgdtp doctor``."""

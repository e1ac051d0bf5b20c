"""The two ways a training step runs, chosen once at setup: :class:`~lightning_sgdtp.engine.compiled.CompiledStep`
(the LightningModule's step compiled whole: data, tensor and hybrid parallel) and
:class:`~lightning_sgdtp.engine.pipelined.PipelinedStep` (the model split into stages under a pipeline schedule).
Both get plain inputs (the module, the layout, the config, a :class:`~lightning_sgdtp.sync.grad_sync.GradSync`), never
the strategy."""

"""Lightning's two front ends (the Trainer's ``SGDTPStrategy``, Fabric's ``SGDTPFabricStrategy``), their registration, and the
Lightning-free core both delegate to (:mod:`~lightning_sgdtp.frontends.job`). The only folder that imports Lightning."""

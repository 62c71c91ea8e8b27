"""How a pass is computed: the PyTorch path (eager: the reference, and the GPU's) or the native C++
kernels on a CPU (`native/`); `engines.Backend` is the choice, made once and handed to the engine."""

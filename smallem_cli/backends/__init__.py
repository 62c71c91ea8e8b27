"""How a pass is computed: the PyTorch path (eager: the reference, and the GPU's) or the native C++
kernels on a CPU (`native/`); `engines` chooses, `steps` is what a pass asks for."""

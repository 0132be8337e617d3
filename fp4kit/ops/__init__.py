"""Ops: one module per raw_kernels/*.cu file: validate inputs, pick the kernel, launch into out=."""

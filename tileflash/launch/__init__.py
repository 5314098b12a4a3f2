"""The launch layer: the only place kernels are launched (compile once, then direct launches; plans; workspace)."""

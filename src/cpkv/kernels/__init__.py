"""Triton kernels, each beside the pure-torch reference that its tests compare against (triton imported lazily)."""

"""The model: the transformer (logical axis names only), attention kernels, RoPE, the loss,
MoE balance and FLOPs. May import jaxtrain.core and jaxtrain.parallel (no import circle);
never run, analysis, data, interop or the commands."""

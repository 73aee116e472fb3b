"""The model, plain math: the transformer (logical axis names only), its blocks, the reference attention, MLA, MoE
routing and one device's experts, MTP, RoPE, the loss, MoE balance, the parameter-role table and FLOPs. Imports
only jaxtrain.core; how it runs on a mesh reaches it through `ops` from the plan the step installs."""

"""Tests of resumerge.inputs.adapters: real PEFT LoRA adapters against PEFT's own merge, refusals, hub adapters."""

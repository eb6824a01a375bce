"""Tests of resumerge.adapters: real PEFT LoRA adapters against PEFT's own merge, refusals, hub-hosted adapters."""

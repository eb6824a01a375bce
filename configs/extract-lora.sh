# LoRA extraction (mergekit-extract-lora's flags; like mergekit, it takes no YAML): a rank-32 PEFT adapter of a
# fine-tune against its base (replace the paths with yours). The first line plans it and writes nothing: what it
# reads, the peak RAM and the time here; the second runs it (journaled: `resumerge resume out-lora/` after a kill).
resumerge extract-lora --model ./models/chat --base-model ./models/base --out-path out-lora --max-rank 32 --plan
resumerge extract-lora --model ./models/chat --base-model ./models/base --out-path out-lora --max-rank 32

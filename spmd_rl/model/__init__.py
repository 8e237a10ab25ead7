"""The model side, taking plain values, never the config: loading, random init and FSDP2 wrapping
(loading), model and tokenizer directories checked before loading (files), tokenizers (tokenizer),
fused decoder kernels (fused_kernels), the chunked log-prob head (logprob_head), packed
variable-length attention (varlen_attention), the actor's LoRA adapter, PEFT's (lora), and a
reward model's scores of conversations (reward_model)."""

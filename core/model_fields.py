"""The config.json fields core.model_config knows, by how it treats them, and transformers' defaults for those a
config may leave out (data only; the checks are core.model_config's)."""
from __future__ import annotations

VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")

# Read by the decoder (each checked for the values it can honour).
USED_CONFIG_FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "hidden_act", "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
    "original_max_position_embeddings", "attention_bias", "mlp_bias", "pretraining_tp", "use_sliding_window",
    "sliding_window", "max_window_layers", "layer_types", "bos_token_id", "eos_token_id", "pad_token_id",
    "tars_vision",
)
# Accepted with any value: metadata, and training- or generation-time settings that do not change the logits
# (attention_dropout only acts in training; the engine's sampling comes from each request, not from the config).
IGNORED_CONFIG_FIELDS = (
    "transformers_version", "torch_dtype", "dtype", "use_cache", "initializer_range", "attention_dropout",
    "_name_or_path", "name_or_path", "output_hidden_states", "output_attentions", "return_dict", "torchscript",
    "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "chunk_size_feed_forward",
    "pruned_heads", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "is_decoder", "use_bfloat16", "tf_legacy_loss", "_attn_implementation", "_commit_hash",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # what tools write beside the model: Unsloth's marks (transformers' own "_..." notes are ignored by their prefix)
    "unsloth_version", "unsloth_fixed",
)
# Accepted only at these (transformers' default) values: anything else changes the model in a way not implemented.
DEFAULT_ONLY_FIELDS = {"is_encoder_decoder": False, "add_cross_attention": False, "tie_encoder_decoder": False,
                       "cross_attention_hidden_size": None}
ACCEPTED_CONFIG_FIELDS = tuple(sorted(set(USED_CONFIG_FIELDS) | set(IGNORED_CONFIG_FIELDS) | set(DEFAULT_ONLY_FIELDS)))
# Refused whatever their value (other than null), with the reason.
REFUSED_FIELDS = {
    "quantization_config": "quantized checkpoints are not supported (the decoder reads plain fp32/bf16/fp16 weights)",
    "auto_map": "a checkpoint with its own modelling code (auto_map) is not the stock architecture",
}

# transformers' defaults for fields a config.json may leave out (Qwen2Config / LlamaConfig / Qwen2(.5)-VL text
# configs, transformers 5).
_HF_DEFAULTS = {
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=32768, bos_token_id=None, eos_token_id=None),
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  bos_token_id=None, eos_token_id=None),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32, bos_token_id=1,
                    eos_token_id=2),
}
for _mt in VL_MODEL_TYPES:
    _HF_DEFAULTS[_mt] = dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                             num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=32768,
                             rms_norm_eps=1e-5, bos_token_id=151643, eos_token_id=151645)

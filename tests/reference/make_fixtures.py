"""Makes llmq's model test fixtures and their reference outputs with Hugging Face transformers.

The fixtures are tiny random-weight checkpoints (committed, a few hundred KB each) and what an
independent implementation (transformers on PyTorch, CPU) computes for them. References are
computed in float64 and stored as float32: transformers' own float32 RoPE drifts by up to 1e-2
at position 100 with rope_theta 1e6, which would hide real errors of that size.

  tests/fixtures/tiny-llama/     Llama, f32 safetensors, untied embeddings
  tests/fixtures/tiny-qwen2/     Qwen2, f16, q/k/v biases, tied embeddings, two safetensors shards
  tests/fixtures/tiny-qwen3/     Qwen3, bf16, q/k RMS norms, tied embeddings
  tests/fixtures/tiny-mistral/   Llama-family with an 8-token sliding window (Mistral)
  tests/fixtures/tiny-llama3/    Llama 3.1's scaled RoPE (llama3), bf16, original context 32
  tests/fixtures/tiny-llama-linear/  linear RoPE scaling (factor 2), f32
  tests/fixtures/tiny-llama-dynamic/ dynamic NTK RoPE past a 48-token context, f32
  tests/fixtures/tiny-qwen2-yarn/    YaRN (factor 4, original context 32), f32
  tests/fixtures/tiny-phi3/      Phi-3: fused qkv and gate/up projections, long RoPE with its
                                 short and long factors (original context 32), 3/4 of each head
                                 rotated (Phi-4-mini), f32
  tests/fixtures/tiny-gemma2/    Gemma 2: sandwich norms, GELU, scaled embeddings, scores and
                                 logits soft-capped (caps small enough to act), sliding and global
                                 layers (window 8), query_pre_attn_scalar unlike head_dim, f32
  tests/fixtures/tiny-gemma3/    Gemma 3 text: q/k norms, a sliding layer with its own rope base
                                 and a global one with linear scaling, bf16
  tests/fixtures/tiny-mixtral/   Mixtral: 4 experts, top 2 renormalised, f32
  tests/fixtures/tiny-qwen3-moe/ Qwen3-MoE: a dense layer then an expert layer (8 experts, top 3,
                                 not renormalised), q/k norms, bf16
  tests/fixtures/tiny-qwen2-moe/ Qwen2-MoE: 4 experts, top 2 not renormalised, and a shared expert
                                 (96 wide) behind its own sigmoid gate; q/k/v biases, f32
  tests/fixtures/tiny-lfm2/      LFM2: short gated convolutions (kernel 3, with bias) in three
                                 layers, grouped-query attention with q/k norms in one, f32
  tests/fixtures/tiny-qwen35/    Qwen3.5 text: gated DeltaNet in three layers (2 key heads, 4
                                 value heads, convolution of 4; decays drawn as trained ones
                                 have them), gated attention with q/k norms and half of each
                                 head rotated in one, untied output, f32
  tests/fixtures/tiny-llama.gguf the tiny Llama as GGUF: F32, F16, BF16, Q8_0, Q4_0, Q4_1 tensors,
                                 Q/K rows permuted as llama.cpp stores them, GPT-2 style BPE
  tests/fixtures/tiny-mixtral.gguf, tiny-qwen3-moe.gguf, tiny-phi3.gguf: those fixtures as GGUF
                                 (gguf_moe: experts stacked and quantized; gguf_phi3: fused
                                 projections, long RoPE's factors as tensors), each with its
                                 -gguf-reference.safetensors
  tests/fixtures/tiny-qwen35.gguf, tiny-lfm2.gguf: the hybrids as llama.cpp's own converter
                                 writes them (gguf_hybrids): Qwen3.5's fixture in F32; an LFM2
                                 without convolution biases in Q8_0, with its
                                 -gguf-reference.safetensors (+ .json) from transformers' GGUF
                                 loader
  each dir's reference.safetensors: for every case, the prompt ids and the logits of every position
  tests/fixtures/tokenizers-reference.json: reference encodings and chat templates of the real
                                 Llama-3, Qwen3 and Mistral tokenizers (tokenizers_reference.py)
  tests/fixtures/gemma3-270m-reference.json: the real Gemma 3 270M Q4_K_M GGUF (K-quants, a
                                 262k SentencePiece vocabulary): for a few prompts, their ids,
                                 transformers' greedy continuation and the 64 largest logits at
                                 the first generated position
  tests/fixtures/smollm2-reference.safetensors (+ .json): the real SmolLM2-135M-Instruct GGUF,
                                 chat prompt "What is the capital of France?": prompt ids, logits
                                 at the first generated position, greedy continuation

The rope types whose frequencies depend on the length (dynamic, longrope) are recorded as
transformers computes them decoding one token at a time (each position rotated for the length
up to it), which is what llmq does for every position (llmq_text::rope says why).

Run with the reference venv (deploy/setup/setup.sh reference), for every fixture or the named ones:
  .cache/pyref/bin/python tests/reference/make_fixtures.py [tiny-llama3 ...]
"""
import json
import os
import shutil
import sys
import zlib

import numpy as np
import torch
from safetensors.torch import save_file

import tokenizers_reference

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIX = os.path.join(ROOT, "tests", "fixtures")
torch.manual_seed(0)
np.random.seed(0)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "Berlin is the capital of Germany; Rome is the capital of Italy. 0123456789 numbers and "
    "punctuation: (a), [b], {c}! Streams of tokens flow through queues, schedulers and caches. "
    "Café, naïve, 東京, emoji 🙂 — unicode text must round-trip through the tokenizer. "
) * 8


def make_tokenizer(dest):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(os.path.join(dest, "tokenizer.json"))
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "chat_template": CHATML, "model_max_length": 512}, f, indent=1)
    return tok


def cases(vocab):
    g = torch.Generator().manual_seed(1)
    lengths = [1, 5, 37, 100]
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def incremental_logits(model, ids):
    """Logits of every position, one token at a time through transformers' cache."""
    from transformers import DynamicCache

    cache, rows = DynamicCache(config=model.config), []
    for p in range(len(ids)):
        out = model(ids[None, p:p + 1], past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[p]]))
        cache = out.past_key_values
        rows.append(out.logits[0, -1])
    return torch.stack(rows)


def write_reference(vocab, dest, incremental=False):
    # Reloaded from the files just written, in float64 from the start (casting a float32 model
    # keeps its float32 RoPE tables).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    out = {}
    for i, ids in enumerate(cases(vocab)):
        with torch.no_grad():
            logits = (incremental_logits(model, ids) if incremental else model(ids[None, :]).logits[0]).float()
        out[f"case{i}.ids"] = ids.to(torch.int32).contiguous()
        out[f"case{i}.logits"] = logits.contiguous()
    save_file(out, os.path.join(dest, "reference.safetensors"))


def save_hf(model, dest, dtype, shards=1):
    from transformers import GenerationConfig

    model = model.to(dtype)
    model.save_pretrained(dest, max_shard_size="100KB" if shards > 1 else "1GB")
    GenerationConfig(eos_token_id=2, bos_token_id=None).save_pretrained(dest)
    return model.double()


def tiny_dir(name, root=FIX):
    dest = os.path.join(root, name)
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    return dest


COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
              bos_token_id=None, eos_token_id=2, pad_token_id=0)


def randomize(model, scale=0.08):
    # Larger than default init, so that logits vary and a wrong op shows up clearly.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p))


def build(cls_cfg, cls_model, name, dtype, shards=1, seeded=False, incremental=False, adjust=None,
          root=FIX, **extra):
    """seeded: the weights drawn from a seed of the fixture's own (fixtures added later do not
    change the earlier ones' random stream); adjust: redraws what `randomize` would make
    unlike a trained model of the family; root: where the fixture's directory goes."""
    if seeded:
        torch.manual_seed(zlib.crc32(name.encode()))
    dest = tiny_dir(name, root)
    tok = make_tokenizer(dest)
    vocab = tok.get_vocab_size()
    cfg = cls_cfg(vocab_size=vocab, **{**COMMON, **extra})
    cfg._attn_implementation = "eager"
    model = cls_model(cfg)
    randomize(model)
    if adjust:
        adjust(model)
    model = save_hf(model, dest, dtype, shards)
    write_reference(vocab, dest, incremental)
    return model, tok, cfg


def gguf_writer(name, arch, cfg):
    """tests/fixtures/<name>.gguf's writer, with the metadata every architecture has."""
    import gguf

    path = os.path.join(FIX, f"{name}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    return path, w


def gguf_tokenizer(w, tok):
    """The fixtures' byte-level BPE (a `tokenizers.Tokenizer`) as GGUF tokenizer metadata."""
    vocab = tok.get_vocab()
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    model_json = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHATML)


def llama_permute(t, heads):
    """llama.cpp's Q/K row order: per head, the two rotary halves interleaved."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def gguf_llama(model, tok, cfg):
    import gguf
    from gguf import GGMLQuantizationType as Q

    path, w = gguf_writer("tiny-llama", "llama", cfg)
    gguf_tokenizer(w, tok)

    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    plan = {  # tensor name -> GGML type: every supported type appears
        "token_embd.weight": Q.F32, "output_norm.weight": Q.F32, "output.weight": Q.Q8_0,
        "blk.0.attn_q.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.Q4_0, "blk.0.attn_v.weight": Q.Q4_1,
        "blk.0.attn_output.weight": Q.F16, "blk.0.ffn_gate.weight": Q.BF16,
        "blk.0.ffn_up.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q4_1,
        "blk.1.attn_q.weight": Q.Q4_0, "blk.1.attn_k.weight": Q.Q4_1, "blk.1.attn_v.weight": Q.Q8_0,
        "blk.1.attn_output.weight": Q.Q4_0, "blk.1.ffn_gate.weight": Q.Q4_0,
        "blk.1.ffn_up.weight": Q.F16, "blk.1.ffn_down.weight": Q.BF16,
    }
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names.update({p + "input_layernorm.weight": f"blk.{i}.attn_norm.weight",
                      p + "post_attention_layernorm.weight": f"blk.{i}.ffn_norm.weight",
                      p + "self_attn.q_proj.weight": f"blk.{i}.attn_q.weight",
                      p + "self_attn.k_proj.weight": f"blk.{i}.attn_k.weight",
                      p + "self_attn.v_proj.weight": f"blk.{i}.attn_v.weight",
                      p + "self_attn.o_proj.weight": f"blk.{i}.attn_output.weight",
                      p + "mlp.gate_proj.weight": f"blk.{i}.ffn_gate.weight",
                      p + "mlp.up_proj.weight": f"blk.{i}.ffn_up.weight",
                      p + "mlp.down_proj.weight": f"blk.{i}.ffn_down.weight"})
    for hf, gg in names.items():
        t = sd[hf]
        if gg.endswith("attn_q.weight"):
            t = llama_permute(t, cfg.num_attention_heads)
        elif gg.endswith("attn_k.weight"):
            t = llama_permute(t, cfg.num_key_value_heads)
        qt = plan.get(gg, Q.F32)
        if qt == Q.F32:
            w.add_tensor(gg, t.astype(np.float32))
        elif qt == Q.F16:
            w.add_tensor(gg, t.astype(np.float16))
        else:
            w.add_tensor(gg, gguf.quants.quantize(t.astype(np.float32), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_moe(name):
    """tests/fixtures/<name>.gguf from the Hugging Face fixture <name> (Mixtral as llama.cpp writes
    it: arch `llama` with experts, Q/K permuted; Qwen3-MoE as `qwen3moe`), the experts stacked
    (`ffn_*_exps`) in Q8_0, Q4_0, Q4_1 and Q5_0, the rest F32, F16 and Q8_0; and
    <name>-gguf-reference.safetensors: transformers' logits for the reference cases with every
    weight replaced by what the gguf package dequantizes the file's tensors to."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    src = os.path.join(FIX, name)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    cfg = model.config
    tok = Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    mixtral = cfg.model_type == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    path, w = gguf_writer(name, arch, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    experts = cfg.num_local_experts if mixtral else cfg.num_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if not mixtral:
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    gguf_tokenizer(w, tok)

    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    kinds = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0]

    def layer(i, p):
        tensors = {
            f"blk.{i}.attn_q.weight": (p + "self_attn.q_proj.weight", Q.Q8_0),
            f"blk.{i}.attn_k.weight": (p + "self_attn.k_proj.weight", Q.Q4_1),
            f"blk.{i}.attn_v.weight": (p + "self_attn.v_proj.weight", Q.F16),
        }
        if p + "self_attn.q_norm.weight" in sd:
            tensors[f"blk.{i}.attn_q_norm.weight"] = (p + "self_attn.q_norm.weight", Q.F32)
            tensors[f"blk.{i}.attn_k_norm.weight"] = (p + "self_attn.k_norm.weight", Q.F32)
        if p + "mlp.gate.weight" in sd:
            # transformers holds each layer's experts stacked, gate and up fused: [E, 2F, H].
            tensors[f"blk.{i}.ffn_gate_inp.weight"] = (p + "mlp.gate.weight", Q.F32)
            parts = (("ffn_gate_exps", "gate_up_proj", 0), ("ffn_up_exps", "gate_up_proj", 1), ("ffn_down_exps", "down_proj", None))
            for j, (gg, hf, half) in enumerate(parts):
                tensors[f"blk.{i}.{gg}.weight"] = ((p + "mlp.experts." + hf, half), kinds[(i + j) % len(kinds)])
        else:
            for gg, hf in zip(("ffn_gate", "ffn_up", "ffn_down"), ("gate_proj", "up_proj", "down_proj")):
                tensors[f"blk.{i}.{gg}.weight"] = (p + f"mlp.{hf}.weight", Q.Q8_0)
        return tensors

    tensors = gguf_plan(cfg, layer)

    def source(hf):
        if isinstance(hf, tuple):
            key, half = hf
            t = sd[key]
            return t if half is None else np.split(t, 2, axis=1)[half]
        return sd[hf]

    for gg, (hf, qt) in tensors.items():
        t = source(hf).astype(np.float32)
        if mixtral and gg.endswith("attn_q.weight"):
            t = llama_permute(t, cfg.num_attention_heads)
        elif mixtral and gg.endswith("attn_k.weight"):
            t = llama_permute(t, cfg.num_key_value_heads)
        gguf_add(w, gg, t, qt)
    gguf_finish(w)
    gguf_reference(name, model, path, tensors, permuted=mixtral)


def gguf_reference(name, model, path, tensors, permuted=False, incremental=False):
    """<name>-gguf-reference.safetensors: transformers' logits for the reference cases with
    every weight of `model` replaced by what the gguf package dequantizes the file's tensors to
    (`tensors`: GGUF name -> (Hugging Face name, or (name, half) of a fused [E, 2F, H] stack,
    type)); `permuted`: Q/K rows in llama.cpp's order."""
    import gguf

    cfg = model.config
    sd = model.state_dict()
    reader = gguf.GGUFReader(path)
    new = {}
    for t in reader.tensors:
        if t.name not in tensors:
            continue
        hf, _ = tensors[t.name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        v = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float64)
        if permuted and t.name.endswith("attn_q.weight"):
            v = llama_unpermute(v, cfg.num_attention_heads)
        elif permuted and t.name.endswith("attn_k.weight"):
            v = llama_unpermute(v, cfg.num_key_value_heads)
        if isinstance(hf, tuple) and hf[1] is not None:
            new.setdefault(hf[0], [None, None])[hf[1]] = v
        else:
            new[hf[0] if isinstance(hf, tuple) else hf] = torch.from_numpy(np.ascontiguousarray(v))
    for k, v in new.items():
        if isinstance(v, list):
            new[k] = torch.from_numpy(np.concatenate(v, axis=1))
    missing = set(sd) - set(new)
    assert not missing, missing
    model.load_state_dict(new, strict=True)
    out = {}
    for i, ids in enumerate(cases(cfg.vocab_size)):
        with torch.no_grad():
            logits = (incremental_logits(model, ids) if incremental else model(ids[None, :]).logits[0]).float()
        out[f"case{i}.ids"] = ids.to(torch.int32).contiguous()
        out[f"case{i}.logits"] = logits.contiguous()
    save_file(out, os.path.join(FIX, f"{name}-gguf-reference.safetensors"))


def gguf_phi3():
    """tests/fixtures/tiny-phi3.gguf from the Hugging Face fixture as llama.cpp writes Phi-3:
    q/k/v fused (`attn_qkv`), gate and up fused (`ffn_up`), the long RoPE's factors as the tensors
    `rope_factors_short` and `rope_factors_long`, 3/4 of each head rotated; and its reference
    (one token at a time, as for the Hugging Face fixture: long RoPE depends on the length)."""
    from gguf import GGMLQuantizationType as Q
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    name = "tiny-phi3"
    src = os.path.join(FIX, name)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64, attn_implementation="eager").eval()
    cfg = model.config
    rp = cfg.rope_parameters
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    path, w = gguf_writer(name, "phi3", cfg)
    w.add_rope_dimension_count(int(head_dim * rp["partial_rotary_factor"]))
    original = rp["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(original)
    scale = cfg.max_position_embeddings / original
    w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
    gguf_tokenizer(w, Tokenizer.from_file(os.path.join(src, "tokenizer.json")))
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    tensors = gguf_plan(cfg, lambda i, p: {
        f"blk.{i}.attn_qkv.weight": (p + "self_attn.qkv_proj.weight", Q.Q8_0),
        f"blk.{i}.ffn_up.weight": (p + "mlp.gate_up_proj.weight", Q.Q5_0),
        f"blk.{i}.ffn_down.weight": (p + "mlp.down_proj.weight", Q.Q4_1),
    })
    for gg, (hf, qt) in tensors.items():
        gguf_add(w, gg, sd[hf].astype(np.float32), qt)
    w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], dtype=np.float32))
    gguf_finish(w)
    gguf_reference(name, model, path, tensors, incremental=True)


def gguf_plan(cfg, layer):
    """GGUF name -> (Hugging Face name, GGML type) of the tensors every fixture has (embedding,
    final norm, output; each layer's norms and attention output), with `layer(i, prefix)`'s."""
    from gguf import GGMLQuantizationType as Q

    tensors = {"token_embd.weight": ("model.embed_tokens.weight", Q.F32),
               "output_norm.weight": ("model.norm.weight", Q.F32),
               "output.weight": ("lm_head.weight", Q.Q8_0)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors.update({
            f"blk.{i}.attn_norm.weight": (p + "input_layernorm.weight", Q.F32),
            f"blk.{i}.ffn_norm.weight": (p + "post_attention_layernorm.weight", Q.F32),
            f"blk.{i}.attn_output.weight": (p + "self_attn.o_proj.weight", Q.Q4_0),
        })
        tensors.update(layer(i, p))
    return tensors


def gguf_add(w, name, t, qt):
    """A tensor in GGML type `qt` (F32, F16 or a quantized type)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    if qt == Q.F32:
        w.add_tensor(name, t)
    elif qt == Q.F16:
        w.add_tensor(name, t.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(t, qt), raw_dtype=qt)


def gguf_finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_unpermute(t, heads):
    return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def reference_gguf(dirname, fname, out_prefix, chat=None, greedy=0):
    """Loads a GGUF with transformers (which dequantizes it) and records its outputs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dirname, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(dirname, gguf_file=fname, dtype=torch.float64)
    model.eval()
    out, meta = {}, {}
    if chat is None:
        vocab = model.config.vocab_size
        for i, ids in enumerate(cases(vocab)):
            with torch.no_grad():
                logits = model(ids[None, :]).logits[0].float()
            out[f"case{i}.ids"] = ids.to(torch.int32).contiguous()
            out[f"case{i}.logits"] = logits.contiguous()
        texts = ["Paris is the capital of France.", "Café 東京 🙂 0123", " spaces  and\nnewlines"]
        meta["tokenizer"] = [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in texts]
    else:
        msgs = [{"role": "user", "content": chat}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()
            gen = model.generate(ids, max_new_tokens=greedy, do_sample=False)[0, ids.shape[1]:]
        out["prompt.ids"] = ids[0].to(torch.int32).contiguous()
        out["first.logits"] = logits.contiguous()
        out["greedy.ids"] = gen.to(torch.int32).contiguous()
        meta.update(chat=chat, prompt_text=text, greedy_text=tok.decode(gen, skip_special_tokens=True))
    save_file(out, out_prefix + ".safetensors")
    with open(out_prefix + ".json", "w") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
    return meta


def rope_families():
    """The rope scaling types and the families that use them; each past its original context in
    the longer cases (37 and 100 tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM

    g = torch.Generator().manual_seed(3)
    rotary_pairs = 6  # Phi-3's 16-wide heads, 3/4 rotated
    return {
        "tiny-llama3": lambda: build(
            LlamaConfig, LlamaForCausalLM, "tiny-llama3", torch.bfloat16, seeded=True, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        "tiny-llama-linear": lambda: build(
            LlamaConfig, LlamaForCausalLM, "tiny-llama-linear", torch.float32, seeded=True, tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        "tiny-llama-dynamic": lambda: build(
            LlamaConfig, LlamaForCausalLM, "tiny-llama-dynamic", torch.float32, seeded=True, incremental=True,
            tie_word_embeddings=False, max_position_embeddings=48,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
        "tiny-qwen2-yarn": lambda: build(
            Qwen2Config, Qwen2ForCausalLM, "tiny-qwen2-yarn", torch.float32, seeded=True, tie_word_embeddings=True,
            max_position_embeddings=128,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32}),
        "tiny-phi3": lambda: build(
            Phi3Config, Phi3ForCausalLM, "tiny-phi3", torch.float32, seeded=True, incremental=True,
            tie_word_embeddings=False, original_max_position_embeddings=32, pad_token_id=0,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "short_factor": (1.0 + torch.rand(rotary_pairs, generator=g)).tolist(),
                             "long_factor": (2.0 + 6.0 * torch.rand(rotary_pairs, generator=g)).tolist()}),
    }


def gemma_families():
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    gemma = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                 layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh",
                 tie_word_embeddings=True, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    return {
        "tiny-gemma2": lambda: build(
            Gemma2Config, Gemma2ForCausalLM, "tiny-gemma2", torch.float32, seeded=True,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **gemma),
        "tiny-gemma3": lambda: build(
            Gemma3TextConfig, Gemma3ForCausalLM, "tiny-gemma3", torch.bfloat16, seeded=True,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
            **gemma),
    }


def moe_families():
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    return {
        "tiny-mixtral": lambda: build(
            MixtralConfig, MixtralForCausalLM, "tiny-mixtral", torch.float32, seeded=True,
            tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0),
        "tiny-qwen3-moe": lambda: build(
            Qwen3MoeConfig, Qwen3MoeForCausalLM, "tiny-qwen3-moe", torch.bfloat16, seeded=True,
            tie_word_embeddings=False, head_dim=16, num_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=32, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0],
            rope_theta=1000000.0),
        "tiny-qwen2-moe": lambda: build(
            Qwen2MoeConfig, Qwen2MoeForCausalLM, "tiny-qwen2-moe", torch.float32, seeded=True,
            tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=96, norm_topk_prob=False, rope_theta=1000000.0),
    }


def qwen35_decays(model):
    """Gated DeltaNet's decays drawn as a trained model has them (most channels remember for
    tens of tokens, some forget fast), not from `randomize`'s scale, which would forget nearly
    everything at every token and hide a state carried wrongly."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.5).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) - 2.0)


QWEN35 = dict(
    num_hidden_layers=4, head_dim=16, tie_word_embeddings=False,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
LFM2 = dict(
    num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3,
    block_auto_adjust_ff_dim=False, norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def hybrid_families():
    from transformers import Lfm2Config, Lfm2ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return {
        "tiny-qwen35": lambda: build(Qwen3_5TextConfig, Qwen3_5ForCausalLM, "tiny-qwen35", torch.float32,
                                     seeded=True, adjust=qwen35_decays, **QWEN35),
        "tiny-lfm2": lambda: build(Lfm2Config, Lfm2ForCausalLM, "tiny-lfm2", torch.float32, seeded=True,
                                   conv_bias=True, **LFM2),
    }


def llama_cpp_convert(conversions):
    """llama.cpp's own converter (convert_hf_to_gguf.py in the llama-cpp-python source package
    that set-up fetches for its chat templates, unpacked once) on Hugging Face directories:
    `conversions` is a list of (source directory, GGUF file, outtype (f32, q8_0, ...), extra
    flags). The tiny fixtures' tokenizer is not in its table of known pre-tokenizers: it is told
    GPT-2's."""
    import subprocess
    import tarfile
    import tempfile

    downloads = os.path.join(ROOT, ".cache", "downloads")
    sdist = next((f for f in sorted(os.listdir(downloads)) if f.startswith("llama_cpp_python-")), None)
    if sdist is None:
        sys.exit("llama-cpp-python's source package is not in .cache/downloads: run deploy/setup/setup.sh")
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(os.path.join(downloads, sdist)) as tar:
            tar.extractall(tmp, filter="data")
        top = os.path.join(tmp, os.listdir(tmp)[0], "vendor", "llama.cpp")
        run = ("import sys; sys.path[:0] = ['.', 'gguf-py']; import conversion.base as b; "
               "b.TextModel.get_vocab_base_pre = lambda self, tok: 'gpt-2'; import convert_hf_to_gguf as c; "
               "sys.argv = ['convert', *sys.argv[1:]]; c.main()")
        for src, dest, outtype, flags in conversions:
            done = subprocess.run([sys.executable, "-c", run, src, "--outfile", dest, "--outtype", outtype, *flags],
                                  cwd=top, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"llama.cpp's converter failed on {src}:\n{done.stderr[-3000:]}")


def gguf_hybrids():
    """tests/fixtures/tiny-qwen35.gguf: the Qwen3.5 fixture as llama.cpp converts it (norms
    stored with their 1 added, A as -exp(A_log), value heads reordered, projections renamed),
    F32; its logits are the fixture's reference. tests/fixtures/tiny-lfm2.gguf: LFM2 as
    published, without a convolution bias (llama.cpp's format has none), in Q8_0, with
    -gguf-reference.safetensors from transformers' own GGUF loader (which dequantizes it)."""
    import tempfile
    from transformers import Lfm2Config, Lfm2ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        build(Lfm2Config, Lfm2ForCausalLM, "tiny-lfm2", torch.float32, seeded=True, root=tmp, conv_bias=False,
              **LFM2)
        llama_cpp_convert([
            # Without the multi-token-prediction head (the fixture has none; llmq does not use it).
            (os.path.join(FIX, "tiny-qwen35"), os.path.join(FIX, "tiny-qwen35.gguf"), "f32", ["--no-mtp"]),
            (os.path.join(tmp, "tiny-lfm2"), os.path.join(FIX, "tiny-lfm2.gguf"), "q8_0", []),
        ])
    reference_gguf(FIX, "tiny-lfm2.gguf", os.path.join(FIX, "tiny-lfm2-gguf-reference"))


GEMMA3_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Café, naïve, 東京:"]


def gemma3_reference():
    """transformers (5.x reads the GGUF with gguf_file=, dequantized to f32) on Gemma 3 270M."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.join(ROOT, ".cache", "models", "gemma3-270m"), "gemma-3-270m-q4_k_m.gguf"
    if not os.path.exists(os.path.join(d, f)):
        print("Gemma 3 270M not fetched (deploy/setup/setup.sh model): its reference was not made", file=sys.stderr)
        return
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    out = []
    for p in GEMMA3_PROMPTS:
        ids = tok(p, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
            gen = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
        top = torch.topk(logits, 64)
        out.append({"prompt": p, "prompt_ids": ids[0].tolist(), "greedy_ids": gen.tolist(),
                    "greedy_text": tok.decode(gen), "top_ids": top.indices.tolist(),
                    "top_logits": [round(v, 5) for v in top.values.tolist()]})
    with open(os.path.join(FIX, "gemma3-270m-reference.json"), "w") as fh:
        json.dump(out, fh, indent=1, ensure_ascii=False)


def main(only):
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    later = {**rope_families(), **gemma_families(), **moe_families(), **hybrid_families(), "gemma3-270m": gemma3_reference,
             "tiny-mixtral.gguf": lambda: gguf_moe("tiny-mixtral"), "tiny-qwen3-moe.gguf": lambda: gguf_moe("tiny-qwen3-moe"),
             "tiny-phi3.gguf": gguf_phi3, "hybrids.gguf": gguf_hybrids}
    if only:
        for name in only:
            later[name]()
        return
    model, tok, cfg = build(LlamaConfig, LlamaForCausalLM, "tiny-llama", torch.float32,
                            tie_word_embeddings=False, rope_theta=10000.0)
    gguf_llama(model, tok, cfg)
    reference_gguf(FIX, "tiny-llama.gguf", os.path.join(FIX, "tiny-llama-gguf-reference"))
    build(Qwen2Config, Qwen2ForCausalLM, "tiny-qwen2", torch.float16, shards=2,
          tie_word_embeddings=True, rope_theta=1000000.0)
    build(Qwen3Config, Qwen3ForCausalLM, "tiny-qwen3", torch.bfloat16,
          tie_word_embeddings=True, rope_theta=1000000.0, head_dim=16)
    build(MistralConfig, MistralForCausalLM, "tiny-mistral", torch.float32,
          tie_word_embeddings=False, sliding_window=8, rope_theta=10000.0)
    tokenizers_reference.main()
    smol = os.path.join(ROOT, ".cache", "models", "smollm2")
    if os.path.exists(os.path.join(smol, "SmolLM2-135M-Instruct.Q4_1.gguf")):
        meta = reference_gguf(smol, "SmolLM2-135M-Instruct.Q4_1.gguf",
                              os.path.join(FIX, "smollm2-reference"),
                              chat="What is the capital of France?", greedy=24)
        print("smollm2 greedy:", meta["greedy_text"])
    else:
        print("SmolLM2 not fetched (deploy/setup/setup.sh model): its reference was not made", file=sys.stderr)
    for make in later.values():
        make()


if __name__ == "__main__":
    main(sys.argv[1:])

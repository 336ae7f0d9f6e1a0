#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets: test/fuzz/corpus/{safetensors,config,shard}/.

Each seed is small: valid files, and files that break one rule each, so that the fuzzers start
next to every check. Regression seeds (inputs that once crashed a parser) are listed here too,
so the committed corpus is exactly what this script writes. Standard library only.

usage: python3 test/fuzz/make_corpus.py
"""
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

# ---- safetensors --------------------------------------------------------------------------

def js(obj, indent=None) -> bytes:
    return json.dumps(obj, indent=indent).encode()


DSIZE = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "U16": 2, "I64": 8}


def st_raw(header: bytes, data: bytes = b"", hlen=None) -> bytes:
    """An 8-byte little-endian header length, the header, the data."""
    return struct.pack("<Q", len(header) if hlen is None else hlen) + header + data


def st_file(tensors, metadata=None, pad=0) -> bytes:
    """A valid file: tensors is a list of (name, dtype, shape); data bytes count up."""
    hdr, off = {}, 0
    if metadata is not None:
        hdr["__metadata__"] = metadata
    for name, dt, shape in tensors:
        n = DSIZE[dt]
        for d in shape:
            n *= d
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(hdr, separators=(",", ":")).encode() + b" " * pad
    return st_raw(h, bytes(i & 0xFF for i in range(off)))


def st_hdr(obj, data_len=0) -> bytes:
    return st_raw(json.dumps(obj).encode(), bytes(data_len))


def T(dt, shape, b, e):
    return {"dtype": dt, "shape": shape, "data_offsets": [b, e]}


SAFETENSORS = {
    "valid_two": st_file([("w", "F32", [2, 3]), ("b", "BF16", [4])], {"format": "pt"}),
    "valid_all_dtypes": st_file([(dt.lower(), dt, [2]) for dt in DSIZE]),
    "valid_scalar_empty": st_file([("s", "F16", []), ("e", "F32", [0, 5]), ("z", "I64", [0])]),
    "valid_padded_header": st_file([("x", "U16", [3])], pad=5),
    "valid_empty_object": st_raw(b"{}      "),
    "valid_opt_names": st_file([("model.decoder.embed_tokens.weight", "F32", [4, 2]),
                                ("model.decoder.layers.0.fc1.bias", "F32", [3])],
                               {"format": "pt"}),
    "bad_truncated": b"\x08\x00\x00",
    "bad_hlen_past_end": st_raw(b"{}", hlen=1000),
    "bad_hlen_huge": st_raw(b"{}", hlen=0xFFFFFFFFFFFFFFFF),
    "bad_hlen_zero": st_raw(b"", b"abc", hlen=0),
    "bad_nul_in_header": st_raw(b'{"a\x00":1}'),
    "bad_trailing": st_raw(b'{} x'),
    "bad_json": st_raw(b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0,'),
    "bad_root_array": st_raw(b"[1,2]"),
    "bad_dtype": st_hdr({"w": T("F8_E4M3", [1], 0, 1)}, 1),
    "bad_dtype_type": st_hdr({"w": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}}, 4),
    "bad_rank": st_hdr({"w": T("F32", [1] * 9, 0, 4)}, 4),
    "bad_shape_negative": st_hdr({"w": T("F32", [-1], 0, 4)}, 4),
    "bad_shape_float": st_hdr({"w": T("F32", [1.5], 0, 4)}, 4),
    "bad_shape_overflow": st_hdr({"w": T("F32", [2**62, 2**62], 0, 4)}, 4),
    "bad_shape_big_int": st_raw(b'{"w":{"dtype":"I64","shape":[99999999999999999999],'
                                b'"data_offsets":[0,8]}}', bytes(8)),
    "bad_offsets_out": st_hdr({"w": T("F32", [2], 0, 8)}, 4),
    "bad_offsets_reversed": st_hdr({"w": T("F32", [0], 4, 0)}, 4),
    "bad_offsets_size": st_hdr({"w": T("F32", [2], 0, 4)}, 8),
    "bad_offsets_three": st_raw(b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}',
                                bytes(8)),
    "bad_offsets_negative": st_hdr({"w": T("U16", [1], -2, 0)}, 4),
    "bad_overlap": st_hdr({"a": T("F32", [2], 0, 8), "b": T("F32", [2], 4, 12)}, 12),
    "bad_entry_type": st_hdr({"w": [1, 2]}),
    "bad_metadata": st_hdr({"__metadata__": 3}),
    # Inputs starting with '{' are model.safetensors.index.json files of a directory holding
    # a.safetensors (x, y), b.safetensors (z), dup.safetensors (x) and bad.safetensors (broken).
    "index_valid": js({"metadata": {"total_size": 30},
                       "weight_map": {"x": "a.safetensors", "y": "a.safetensors",
                                      "z": "b.safetensors"}}),
    "index_partial": js({"weight_map": {"z": "b.safetensors"}}),
    "index_empty": b'{"weight_map": {}}',
    "index_wrong_shard": js({"weight_map": {"x": "b.safetensors", "z": "b.safetensors"}}),
    "index_dup_tensor": js({"weight_map": {"x": "a.safetensors", "y": "dup.safetensors"}}),
    "index_missing_file": js({"weight_map": {"x": "c.safetensors"}}),
    "index_bad_shard": js({"weight_map": {"x": "bad.safetensors"}}),
    "index_path_escape": js({"weight_map": {"x": "../a.safetensors", "y": ".."}}),
    "index_self": js({"weight_map": {"x": "model.safetensors.index.json"}}),
    "index_not_string": b'{"weight_map": {"x": 3}}',
    "index_no_map": b'{"metadata": {}}',
    "dup_keys": st_raw(b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                       b'"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', bytes(8)),
}

# ---- config.json --------------------------------------------------------------------------

OPT_125M = {
    "_name_or_path": "facebook/opt-125m", "_remove_final_layer_norm": False,
    "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "enable_bias": True, "eos_token_id": 2,
    "ffn_dim": 3072, "hidden_size": 768, "init_std": 0.02, "layer_norm_elementwise_affine": True,
    "layerdrop": 0.0, "max_position_embeddings": 2048, "model_type": "opt",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
    "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.21.0.dev0",
    "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
}
OPT_350M = dict(OPT_125M, hidden_size=1024, ffn_dim=4096, num_attention_heads=16,
                num_hidden_layers=24, word_embed_proj_dim=512, do_layer_norm_before=False)
TINY = {"model_type": "opt", "vocab_size": 61, "hidden_size": 24, "ffn_dim": 40,
        "num_attention_heads": 3, "num_hidden_layers": 2, "max_position_embeddings": 32,
        "word_embed_proj_dim": 24, "dtype": "float32", "tie_word_embeddings": False,
        "enable_bias": False, "layer_norm_elementwise_affine": False}


CONFIG = {
    "valid_opt125m": js(OPT_125M, 2) + b"\n",
    "valid_opt350m": js(OPT_350M),
    "valid_tiny": js(TINY),
    "valid_empty": b"{}",
    "valid_float_ints": js(dict(TINY, hidden_size=24.0, vocab_size=6.1e1)),
    "valid_null_tokens": js(dict(TINY, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                 word_embed_proj_dim=None, torch_dtype=None)),
    "valid_unicode": b'{"model_type": "o\\u0070t", "torch_dtype": "bfloat16", "x": "\\ud83d\\ude00"}',
    "bad_model_type": js(dict(TINY, model_type="gpt2")),
    "bad_activation": js(dict(TINY, activation_function="gelu")),
    "bad_heads": js(dict(TINY, num_attention_heads=5)),
    "bad_zero_layers": js(dict(TINY, num_hidden_layers=0)),
    "bad_huge_vocab": js(dict(TINY, vocab_size=2**40)),
    "bad_uint64": b'{"vocab_size": 18446744073709551615}',
    "bad_int_overflow": b'{"hidden_size": 99999999999999999999999}',
    "bad_float_nonint": js(dict(TINY, ffn_dim=40.5)),
    "bad_inf": b'{"dropout": 1e400}',
    "bad_nan": b'{"init_std": NaN}',
    "bad_negative_eps": js(dict(TINY, init_std=-0.02)),
    "bad_token_id": js(dict(TINY, pad_token_id=61)),
    "bad_bool": js(dict(TINY, enable_bias=1)),
    "bad_dtype_long": js(dict(TINY, torch_dtype="float" * 10)),
    "bad_trailing": js(TINY) + b" }",
    "bad_truncated": js(OPT_125M)[:200],
    "bad_not_object": b'[{"model_type": "opt"}]',
    "bad_nested": b"[" * 40 + b"]" * 40,
    "bad_params_absurd": js(dict(TINY, hidden_size=1 << 24, num_attention_heads=1, ffn_dim=1 << 24,
                                 num_hidden_layers=1000000)),
    "bad_empty": b"",
}

# ---- token shards -------------------------------------------------------------------------
# Header ints 3..8 are reserved by the format (0) and read by fuzz_shard.c as the loader's knobs:
# vocab (& 0x1ffff, 0 = 65536), B = 1 + h4 % 4, T = 1 + h5 % 64, h6: shuffle (bit 0),
# world = 1 + (h6 >> 1) % 3, rank = (h6 >> 3) % world; seed = h8 << 32 | h7; h9: bit 0 splits
# the input into several shards (each as long as its count says) opened as a directory, bit 1
# opens them through a glob; there a piece with the loss mask's magic is the previous shard's mask.

MAGIC, VERSION = 20240520, 1
WIDE_MAGIC, WIDE_VERSION = 20240801, 7  # uint32 tokens
MASK_MAGIC, MASK_VERSION = 20241201, 1  # a shard's loss mask, one byte a token


def mask(bits, count=None, magic=MASK_MAGIC, version=MASK_VERSION) -> bytes:
    h = [magic, version, len(bits) if count is None else count] + [0] * 253
    return struct.pack("<256i", *h) + bytes(bits)


def shard(tokens, count=None, magic=MAGIC, version=VERSION, knobs=(), extra=b"") -> bytes:
    h = [magic, version, len(tokens) if count is None else count] + list(knobs)
    h += [0] * (256 - len(h))
    kind = "I" if magic == WIDE_MAGIC else "H"
    return struct.pack("<256i", *h) + struct.pack(f"<{len(tokens)}{kind}", *tokens) + extra


def wide(tokens, version=WIDE_VERSION, **kw) -> bytes:
    return shard(tokens, magic=WIDE_MAGIC, version=version, **kw)


def knobs(vocab=0, B=1, T=8, shuffle=False, world=1, rank=0, seed=0, split=False, glob=False):
    h6 = int(shuffle) | ((world - 1) << 1) | (rank << 3)
    return [vocab, B - 1, T - 1, h6, seed & 0xFFFFFFFF, seed >> 32, int(split) | 2 * int(glob)]


TEXT = list(b"the quick brown fox jumps over the lazy dog. ")
SHARD = {
    "valid_bytes": shard(TEXT),
    "valid_knobs_shuffle": shard(TEXT * 2, knobs=knobs(256, B=2, T=7, shuffle=True, seed=99)),
    "valid_two_ranks": shard(TEXT, knobs=knobs(256, B=2, T=3, world=2, rank=1, seed=1 << 40)),
    "valid_exact_window": shard(list(range(9)), knobs=knobs(16, B=1, T=8)),
    "valid_big_tokens": shard([65535, 0, 40000, 1], knobs=knobs(0, T=2)),
    "split_three": shard(TEXT[:20], knobs=knobs(256, B=2, T=4, split=True)) + shard([])
                   + shard(TEXT[20:]),
    "split_glob_shuffle": shard(TEXT[:9], knobs=knobs(256, B=3, T=8, shuffle=True, seed=7,
                                                      split=True, glob=True))
                          + shard(list(range(30))) + shard([1]),
    "split_bad_second": shard(TEXT, knobs=knobs(256, T=4, split=True)) + shard(TEXT, magic=7),
    "bad_token_vocab": shard(TEXT, knobs=knobs(100)),
    "bad_magic": shard(TEXT, magic=12345),
    "bad_count_mismatch": shard(TEXT, count=len(TEXT) + 1),
    "bad_empty_shard": shard([]),
    "bad_too_small_for_batch": shard(TEXT[:10], knobs=knobs(256, B=4, T=8)),
    "bad_short_header": struct.pack("<3i", MAGIC, VERSION, 0),
    "wide_valid": wide([70000, 5, 131070, 65536, 1, 2, 3, 4, 9, 100000], knobs=knobs(131071, B=2, T=4)),
    "wide_split_mixed": wide(TEXT[:12], knobs=knobs(256, B=2, T=5, shuffle=True, split=True)) + shard(TEXT)
                        + wide(TEXT[12:]),
    "wide_bad_token": wide([70000, 5, 80000], knobs=knobs(75000, T=2)),
    "wide_bad_version": wide(TEXT, version=VERSION),
    "wide_bad_count": wide(TEXT, count=2 * len(TEXT)),
    "mask_valid": shard(TEXT, knobs=knobs(256, B=2, T=6, split=True)) + mask([i % 3 != 0 for i in range(len(TEXT))]),
    "mask_two_shards": shard(TEXT[:20], knobs=knobs(256, B=1, T=5, shuffle=True, split=True))
                       + mask([1, 0] * 10) + shard(TEXT[20:]),
    "mask_bad_count": shard(TEXT, knobs=knobs(256, T=4, split=True)) + mask([1] * 5, count=len(TEXT)),
    "mask_bad_byte": shard(TEXT, knobs=knobs(256, T=4, split=True)) + mask([2] * len(TEXT)),
    "mask_bad_version": shard(TEXT, knobs=knobs(256, T=4, split=True)) + mask([1] * len(TEXT), version=9),
}


# Checkpoint index (fuzz_checkpoint.c): trainer.json, or with a leading "L" the `latest` pointer.
CKPT_OK = {"format": "ferry-checkpoint", "version": 1, "step": 10, "sequences": 40, "seed": 1337,
           "loss_scale": 1.0, "options": {"model": "opt-tiny"}}
CHECKPOINT = {
    "valid.json": js(CKPT_OK),
    "step_string.json": js({**CKPT_OK, "step": "ten"}),
    "negative.json": js({**CKPT_OK, "step": -1}),
    "updates.json": js({**CKPT_OK, "adamw_updates": 7}),
    "updates_over.json": js({**CKPT_OK, "adamw_updates": 11}),
    "updates_float.json": js({**CKPT_OK, "adamw_updates": 7.5}),
    "huge.json": js({**CKPT_OK, "sequences": 2**63 - 1}),
    "wrong_format.json": js({"format": "other"}),
    "array.json": js([1, 2, 3]),
    "latest_ok": b"Lstep-00000010\n",
    "latest_escape": b"L../../etc\n",
    "latest_empty": b"L",
}


# Plan files (fuzz_plan.c).
PLAN_OK = {"model": "opt-125m", "micro_batch": 4, "grad_accum": 2, "seq": 128, "chunk_elems": 38608896,
           "blocks": 3, "prefetch": 2, "recompute": True, "disk_chunks": 0, "pattern": "replicate", "dp": 1, "tp": 1,
           "machine": {"device": "sim"}, "predicted": {"step_s": 1.0}}
PLAN = {
    "valid.json": js(PLAN_OK, indent=2),
    "unknown_key.json": js({**PLAN_OK, "colour": "blue"}),
    "string_batch.json": js({**PLAN_OK, "micro_batch": "four"}),
    "zero_batch.json": js({**PLAN_OK, "micro_batch": 0}),
    "huge_chunk.json": js({**PLAN_OK, "chunk_elems": 2**62}),
    "bad_recompute.json": js({**PLAN_OK, "recompute": 1}),
    "truncated.json": js(PLAN_OK)[:40],
    "not_object.json": b'2, "seq": 128, "chunk_elems": 38608896',  # a bare number: crashed the reader once
}


def main():
    root = os.path.join(HERE, "corpus")
    for name, seeds in (("safetensors", SAFETENSORS), ("config", CONFIG), ("shard", SHARD),
                        ("checkpoint", CHECKPOINT), ("plan", PLAN)):
        d = os.path.join(root, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        for fname, data in sorted(seeds.items()):
            with open(os.path.join(d, fname), "wb") as f:
                f.write(data)
        total = sum(len(v) for v in seeds.values())
        print(f"{d}: {len(seeds)} seeds, {total} bytes")


if __name__ == "__main__":
    main()

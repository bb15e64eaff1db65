"""
Evaluate a model: the loss of a text (per token, bits per byte, perplexity), or its accuracy on
multiple-choice questions in HellaSwag's schema, computed as lm-evaluation-harness computes them.

    python eval.py --out_dir=out-shakespeare-char --text=data/shakespeare_char/input.txt
    python eval.py --init_from=gpt2 --tasks=hellaswag --out=results.json   # a Hugging Face model on HellaSwag
    python eval.py --out_dir=out-shakespeare-char-bert --text=input.txt   # an encoder: masked tokens

--text: every token is scored once, the first after the end-of-text token, in rolling windows of
block_size tokens (the harness's loglikelihood_rolling); bits per byte = the loss in nats / ln 2 /
the text's UTF-8 bytes. An encoder instead predicts a seeded 15% of the tokens, masked.
--tasks: one JSON object a line, {"ctx": ..., "endings": [...], "label": i}: each ending is scored by
the summed log-likelihood of " " + ending after ctx; acc picks the best ending, acc_norm the best per
character of the ending. A prefix LM reads the context both ways. docs/eval.md has the definitions.
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass

import common  # no torch: it sets the signals before torch's import

if __name__ == "__main__":
    common.exit_quietly_on_signals()

import torch
import torch.nn.functional as F

from checkpoint import describe, for_sampling
from hf import load_source
from common import UsageError, check_ranges, fetch_url, parse_settings, read_text_file, usage, write_atomic
from device import pick_device, pick_dtype, precision, run_script
from tokenizer import END_OF_TEXT, GPT2_EOT, hf_end_of_text, token_names

MASK_FRAC = 0.15  # of an encoder's tokens masked for --text, as BERT's pretraining chooses


@dataclass
class EvalConfig:
    out_dir: str = "out"
    init_from: str = "resume"  # "resume" (the run in out_dir), or a Hugging Face model directory or hub name
    ckpt: str = "best"  # "best" (lowest val loss, best.pt) or "latest" (ckpt.pt)
    text: str = ""  # a UTF-8 text file: its loss per token, bits per byte and perplexity
    tasks: str = ""  # a .jsonl file of multiple-choice questions in HellaSwag's schema (ctx, endings, label), or
    # "hellaswag": its validation set, fetched once into the cache ($NANOFORMER_CACHE), as llm.c's hellaswag.py does
    out: str = ""  # also write the results to this JSON file
    batch_size: int = 8  # windows (or endings) scored at once
    seed: int = 1337  # which tokens an encoder's --text masks
    device: str = "auto"
    dtype: str = "auto"  # bf16 on GPUs that have it, fp16 (under autocast), fp32 on the CPU


RANGES = dict(ckpt=("best", "latest"), batch_size="[1, inf)", seed="[0, inf)")


def check(cfg):  # found out before the model loads
    check_ranges(cfg, RANGES)
    if bool(cfg.text) == bool(cfg.tasks):
        raise UsageError("give one of --text=FILE (a text's loss) or --tasks=FILE.jsonl (multiple choice)")
    out = cfg.out
    if out and (os.path.isdir(out) or not os.path.isdir(os.path.dirname(out) or ".")):
        raise UsageError(f"--out={out} is not a file in an existing folder: give a path such as results.json")


def main(argv):
    if {"-h", "--help"} & set(argv):
        print(usage(__doc__, EvalConfig))
        return 0
    cfg = EvalConfig(**parse_settings(argv, EvalConfig)[0])
    check(cfg)
    text = read_text(cfg.text) if cfg.text else None
    questions = read_tasks(tasks_file(cfg.tasks)) if cfg.tasks else None
    device = pick_device(cfg.device)
    weights, autocast = precision(pick_dtype(cfg.dtype, device), device)
    model, ckpt = load_source(cfg.init_from, cfg.out_dir, cfg.ckpt)  # a run's checkpoint or a Hugging Face model
    if cfg.init_from == "resume":
        print(f"eval.py: {describe(ckpt)}", file=sys.stderr)
    model, tok = for_sampling(model, ckpt, device, weights)
    arch = model.config.arch
    if arch == "encoder-decoder":
        raise UsageError("an encoder-decoder is not scored here: eval.py takes a decoder, a prefix LM or an encoder")
    if arch == "encoder" and questions is not None:
        raise UsageError("an encoder gives no likelihood of an ending: --tasks needs a decoder or a prefix LM "
                         "(an encoder takes --text, for its masked tokens)")
    scorer = Scorer(model, vocab_in_use(model, ckpt), cfg.batch_size, device)
    with torch.inference_mode(), autocast:
        if questions is not None:
            results = score_tasks(scorer, tok, end_of_text(ckpt, tok), questions, cfg.tasks)
        elif arch == "encoder":
            results = score_masked(scorer, tok, ckpt["tokens"]["mask"], text, cfg)
        else:
            results = score_text(scorer, tok, end_of_text(ckpt, tok), text, cfg.text)
    if cfg.out:
        write_atomic(cfg.out, (json.dumps(results, indent=1) + "\n").encode())
    return 0


# ----------------------------------------------------------------------------------------------
# Input

def read_text(path):
    text = read_text_file(path, "text file")
    if not text:
        raise UsageError(f"text file {path!r} is empty: give a file with text to score")
    return text


# HellaSwag's validation set (Zellers et al. 2019) where its authors publish it: its URL and its count of questions
HELLASWAG = ("https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl", 10042)


def tasks_file(tasks):
    """The file of --tasks: the one given, or for "hellaswag" the cached validation set (fetched once)."""
    if tasks != "hellaswag":
        return tasks
    url, n = HELLASWAG

    def check(path):  # a cut-off download or an error page has another count of lines
        with open(path, "rb") as f:
            lines = sum(1 for line in f if line.strip())
        return None if lines == n else f"{lines:,} lines, not HellaSwag's {n:,} questions"
    return fetch_url(url, "hellaswag_val.jsonl", check)


def read_tasks(path):
    """The questions of a .jsonl file in HellaSwag's schema: (line number, ctx, endings, label) each;
    blank lines are skipped, anything else malformed is refused with its line number."""
    questions = []
    for n, line in enumerate(read_text_file(path, "task file").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            q = json.loads(line)
        except ValueError as e:
            raise UsageError(f"{where} is not JSON ({e.msg}): write one object a line") from None
        if not isinstance(q, dict) or not isinstance(q.get("ctx"), str):
            raise UsageError(f"{where} lacks \"ctx\", the context (a string): each line is "
                             '{"ctx": ..., "endings": [...], "label": i}')
        endings, label = q.get("endings"), q.get("label")
        if not (isinstance(endings, list) and len(endings) >= 2 and all(isinstance(e, str) and e for e in endings)):
            raise UsageError(f"{where}: \"endings\" should be a list of two or more non-empty strings")
        if isinstance(label, str) and label.isdigit():  # as the Hugging Face copy of HellaSwag has it
            label = int(label)
        if type(label) is not int or not 0 <= label < len(endings):
            raise UsageError(f"{where}: \"label\" should be the index of the right ending, 0 to {len(endings) - 1}, "
                             f"not {label!r}")
        questions.append((n, q["ctx"], endings, label))
    if not questions:
        raise UsageError(f"task file {path!r} holds no question: one JSON object a line")
    return questions


def end_of_text(ckpt, tok):
    """The id that ends a document, which the first token of a text is predicted after; None if the
    vocabulary has none (a character-level dataset prepared from one file)."""
    meta = ckpt["meta"]
    if meta.get("eot") is not None:  # a run's dataset records it
        return meta["eot"]
    if meta["tokenizer"] == "gpt2":
        return GPT2_EOT
    if meta["tokenizer"] == "char":
        return meta["vocab"].index(END_OF_TEXT) if END_OF_TEXT in meta["vocab"] else None
    return hf_end_of_text(ckpt["path"], tok.enc) if os.path.isdir(ckpt["path"]) else None


def vocab_in_use(model, ckpt):
    """The ids that scores are normalised over: the tokenizer's and the objective's own, as hf.py's
    export keeps them (a run's vocab_size rounds up to a multiple of 64 with ids it never sees), so
    that the export in transformers gives the same numbers; a Hugging Face model's all of them."""
    meta = ckpt["meta"]
    if meta["tokenizer"] == "hf":
        return model.config.vocab_size
    return max([meta["vocab_size"] - 1, *token_names(model.config.arch, ckpt["tokens"])]) + 1


def progress(total, what):
    """A function that counts work done and, once the work has taken a second, shows a bar on stderr
    (one line, redrawn with \\r), ended by a newline when the count reaches total."""
    state = dict(done=0, start=time.time(), drawn=0.0)

    def step(k):
        state["done"] += k
        done, now = state["done"], time.time()
        if (now - state["start"] < 1 and not state["drawn"]) or (done < total and now - state["drawn"] < 0.2):
            return  # work of under a second shows nothing; a bar is redrawn 5 times a second at most
        state["drawn"] = now
        bar = "#" * (30 * done // total)
        print(f"\reval.py: {what} [{bar:<30}] {done:,}/{total:,}", end="\n" if done >= total else "",
              file=sys.stderr, flush=True)
    return step


# ----------------------------------------------------------------------------------------------
# Scoring

@dataclass
class Scorer:
    model: torch.nn.Module
    limit: int  # scores are over ids [0, limit): vocab_in_use
    batch_size: int
    device: torch.device

    def log_probs(self, idx, mask=None, prefix_len=None):
        """log p of every id (up to limit) at every position of idx (B, T), in fp32."""
        logits = self.model(idx.to(self.device), mask=None if mask is None else mask.to(self.device),
                            prefix_len=None if prefix_len is None else prefix_len.to(self.device))[0]
        return F.log_softmax(logits[..., :self.limit].float(), dim=-1)


def loglikelihoods(scorer, requests, what):
    """The summed log-likelihood of each request's continuation after its context, both lists of ids,
    as lm-evaluation-harness's _loglikelihood_tokens: the last block_size + 1 tokens of context +
    continuation, less the last, go in; the continuation is scored at the end. Batches take the
    longest first, right-padded: a position never sees a later one, so padding changes no score (a
    prefix LM's prefix, the context, is read both ways, and ends before the padding)."""
    T, prefix_lm = scorer.model.config.block_size, scorer.model.config.arch == "prefix-lm"
    rows = [((ctx + cont)[-(T + 1):][:-1], cont) for ctx, cont in requests]
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    out, bar = [0.0] * len(rows), progress(len(rows), what)
    for start in range(0, len(order), scorer.batch_size):
        batch = order[start:start + scorer.batch_size]
        B, L = len(batch), len(rows[batch[0]][0])
        idx, targets = torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L, dtype=torch.long)
        scored = torch.zeros(B, L, dtype=torch.bool)
        for r, i in enumerate(batch):
            inp, cont = rows[i]
            idx[r, :len(inp)] = torch.tensor(inp)
            targets[r, len(inp) - len(cont):len(inp)] = torch.tensor(cont)
            scored[r, len(inp) - len(cont):len(inp)] = True
        prefix = torch.tensor([len(rows[i][0]) - len(rows[i][1]) + 1 for i in batch]) if prefix_lm else None
        logp = scorer.log_probs(idx, prefix_len=prefix)
        ll = logp.gather(-1, targets.to(logp.device)[..., None])[..., 0].double()
        for r, v in zip(batch, (ll * scored.to(ll.device)).sum(-1).tolist()):
            out[r] = v
        bar(B)
    return out


def rolling_windows(prefix, ids, T):
    """lm-evaluation-harness's rolling windows (get_rolling_token_windows with context_len=1, made
    disjoint) as (context, continuation) pairs that score every id once: the first block_size after
    prefix (the end-of-text token), then block_size at a time after the one id before them; the
    last window's context fills the rest of its block_size."""
    first = min(T, len(ids))
    windows, done = [([prefix], ids[:first])], first
    while done < len(ids):
        n = min(len(ids) - done, T)
        end = done + n
        windows.append((ids[end - T - 1:end - n], ids[end - n:end]))
        done = end
    return windows


def encode_checked(tok, text, where):
    if unknown := tok.unknown(text):
        raise UsageError(f"{where} has characters the model's vocabulary lacks: {''.join(unknown)!r}; remove or "
                         "replace them")
    return tok.encode(text)


def score_text(scorer, tok, eot, text, path):
    ids = encode_checked(tok, text, f"text file {path!r}")
    n_bytes = len(text.encode("utf-8"))
    if eot is None:  # nothing to predict the first token after: it is context only
        print("eval.py: the vocabulary has no end-of-text token: the first token is not scored", file=sys.stderr)
        n_bytes -= len(tok.decode(ids[:1]).encode("utf-8"))
        eot, ids = ids[0], ids[1:]
        if not ids:
            raise UsageError(f"text file {path!r} is one token: give more text")
    windows = rolling_windows(eot, ids, scorer.model.config.block_size)
    nats = -sum(loglikelihoods(scorer, windows, "windows"))
    loss = nats / len(ids)
    results = dict(loss=loss, bits_per_byte=nats / math.log(2) / n_bytes, perplexity=math.exp(loss), n=len(ids))
    print(f"{path}: loss {loss:.4f} (nats a token), bits_per_byte {results['bits_per_byte']:.4f}, perplexity "
          f"{results['perplexity']:.4f} ({len(ids):,} tokens, {n_bytes:,} bytes)")
    return results


def encode_pair(tok, context, continuation, eot):
    """The ids of context and of continuation after it, as lm-evaluation-harness's _encode_pair: the
    context's trailing spaces go to the continuation; the whole is encoded, and the continuation's
    ids are those after the context's own encoding; an empty context is the end-of-text token."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    if not context:
        return [eot], tok.encode(continuation)
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def score_tasks(scorer, tok, eot, questions, path):
    requests, T = [], scorer.model.config.block_size
    for n, ctx, endings, _ in questions:
        where = f"{path} line {n}"
        encode_checked(tok, ctx + "".join(endings), where)
        if eot is None and not ctx.strip():
            raise UsageError(f"{where}: the context is empty and the vocabulary has no end-of-text token to "
                             "stand for it: give every question a context")
        for k, ending in enumerate(endings):
            context, cont = encode_pair(tok, ctx, " " + ending, eot)
            if not 1 <= len(cont) <= T:
                raise UsageError(f"{where}: ending {k} is {len(cont)} tokens after the context; this model scores "
                                 f"1 to block_size={T}: shorten it")
            requests.append((context, cont))
    lls = iter(loglikelihoods(scorer, requests, "endings"))
    right = right_norm = 0
    for _, _, endings, label in questions:
        ll = [next(lls) for _ in endings]
        norm = [v / len(e) for v, e in zip(ll, endings)]  # per character of the ending, its space not counted
        right += max(range(len(ll)), key=ll.__getitem__) == label  # the first of equals, as numpy's argmax
        right_norm += max(range(len(norm)), key=norm.__getitem__) == label
    results = dict(acc=right / len(questions), acc_norm=right_norm / len(questions), n=len(questions))
    print(f"{path}: acc {results['acc']:.4f}, acc_norm {results['acc_norm']:.4f} ({len(questions):,} questions)")
    return results


def score_masked(scorer, tok, mask_id, text, cfg):
    """An encoder's loss and accuracy at a seeded 15% of the text's tokens (at least one a window),
    each replaced by the mask token, in windows of block_size read both ways."""
    ids, T = encode_checked(tok, text, f"text file {cfg.text!r}"), scorer.model.config.block_size
    windows = [ids[i:i + T] for i in range(0, len(ids), T)]
    gen, bar = torch.Generator().manual_seed(cfg.seed), progress(len(windows), "windows")
    nats, right, n = 0.0, 0, 0
    for start in range(0, len(windows), scorer.batch_size):
        batch = windows[start:start + scorer.batch_size]
        L = max(map(len, batch))
        idx, targets = torch.zeros(len(batch), L, dtype=torch.long), torch.full((len(batch), L), -100)
        valid = torch.zeros(len(batch), L, dtype=torch.bool)
        for r, window in enumerate(batch):
            x = torch.tensor(window)
            chosen = torch.randperm(len(window), generator=gen)[:max(1, round(MASK_FRAC * len(window)))]
            targets[r, chosen] = x[chosen]
            x[chosen] = mask_id
            idx[r, :len(window)], valid[r, :len(window)] = x, True
        logp = scorer.log_probs(idx, mask=None if valid.all() else valid)
        targets = targets.to(logp.device)
        at = targets != -100
        nats -= logp[at].gather(-1, targets[at][:, None]).double().sum().item()
        right += (logp[at].argmax(-1) == targets[at]).sum().item()
        n += at.sum().item()
        bar(len(batch))
    results = dict(loss=nats / n, acc=right / n, n=n)
    print(f"{cfg.text}: masked-token loss {results['loss']:.4f} (nats a token), accuracy {results['acc']:.4f} "
          f"({n:,} of {len(ids):,} tokens masked, seed {cfg.seed})")
    return results


if __name__ == "__main__":
    run_script(main, "eval.py", "lower --batch_size, or use smaller weights (--dtype=bfloat16)")

"""The "domains" routing profile: hot experts that depend on what the prompt is about, written into a qwen3moe twin.

Real MoE models route prompts of different kinds to different experts: on Qwen3.6-35B-A3B the hot sets of prompt
classes share only 3-7% of their experts (Jaccard; ``../shared/notes/hybrid-moe-anchors.md``). The other profiles
route every prompt alike. This one gives each layer one expert subset per domain of the bundled corpus
(:data:`artifacts.corpus.DOMAINS`: code, prose, log, chat), each pair of subsets sharing a few experts, so that the
subsets' Jaccard is ``routing_overlap`` (0.05 by default), and steers a prompt to its domain's subset:

* **Vocabulary groups.** Every token gets an affinity to each domain, counted on the corpus with the twin's own
  tokenizer (:func:`twin_tokens`): ``P(domain | token)`` under equal priors, minus ``1 / K``. Tokens the corpus
  never uses have none. The embedding holds ``ALPHA`` times it in dims ``0..K-1``, a constant in dim 32 and zeros in
  a *domain slot* (dims 64..64+K).
* **A context average.** In layer 0, query head 0 is zero, so it attends uniformly to every token before it; its
  value reads the affinity dims only, and the output projection writes them into the slot. The slot holds the
  prompt's mean affinity so far: one token says little (the byte-level vocabulary is shared by all domains), a
  prompt's mean says which domain it is.
* **A router that reads it.** An affine map ``c = A m + b`` of the mean ``m`` is fitted so that each domain's
  average prompt gives the one-hot ``c = e_d``; each router row reads the slot (and the constant, for ``b``) with
  weights such that expert ``e``'s logit gets ``GAIN * sum_{d: e in S_d} c_d``, far more than its random part.
  Within the subset the random part decides, each row scaled as in the skewed profile fitted to the subset's size
  (:func:`artifacts.synth.routing.router_scales`): the busiest half of a domain's subset gets about
  ``routing_top_half`` of its picks. Each layer lays its subsets out on its own seeded permutation.

Everything else is drawn as the uniform twin's. The profile needs a model whose layer 0 is full attention
(qwen3moe), quant blocks this module can write (Q4_0, Q8_0, F16) and enough experts for four subsets of at least
twice the experts a token picks.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import regex
from gguf import GGMLQuantizationType as Q
from gguf import quants
from numpy.typing import NDArray

from artifacts.synth.layout import PlannedTensor, _byte_tokens, vocab
from artifacts.synth.presets import SPECIALS, SynthSpec
from artifacts.synth.routing import RouterTransform, router_scales

AFFINITY_BLOCK = slice(0, 32)  # the token's domain affinities (first K dims): one quant block
CONST_DIM = 32  # a constant in every embedding (the rest of its block zero): the router's bias
SLOT = 64  # the layer-0 head writes the prompt's mean affinity into dims SLOT..SLOT+K (zero in the embedding)
RESERVED = 96
ALPHA = 2.0  # affinity dims, in units of the embedding's std
GAMMA = 4.0  # the slot's gain over the head's output
GAIN = 12.0  # the chosen subset's logit margin, in units of the largest random logit's std
_WRITABLE = (Q.Q4_0, Q.Q8_0, Q.F16)
# the qwen2 pre-tokenizer of the twin's tokenizer, as llama.cpp splits text before its merges
_PRE = regex.compile(r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def domain_names() -> tuple[str, ...]:
    """The domains a twin routes by (the corpus's, in order)."""
    from artifacts.corpus import DOMAINS  # the corpus is the planner's; the twin is counted on it

    return tuple(DOMAINS)


def check(spec: SynthSpec, quant_type: Q) -> None:
    """Raise ValueError when the profile cannot be written for this spec and weight type."""
    if spec.arch != "qwen3moe":
        raise ValueError(f"routing=domains is written into qwen3moe twins (full attention in layer 0), not {spec.arch}: "
                         "use routing=skewed")
    if quant_type not in _WRITABLE:
        raise ValueError(f"routing=domains writes its weights as Q4_0, Q8_0 or F16 blocks, not {quant_type.name}: "
                         "use --quant Q4_0")
    k = len(domain_names())
    if spec.n_expert < 4 * k * spec.n_expert_used:
        raise ValueError(f"routing=domains needs at least {4 * k * spec.n_expert_used} experts for {k} domains of "
                         f"{spec.n_expert_used} picks (this spec has {spec.n_expert}): use --set n_expert=128")
    if spec.n_embd < 2 * RESERVED or spec.head_dim < k:
        raise ValueError(f"routing=domains needs n_embd >= {2 * RESERVED} and head_dim >= {k}")


def twin_tokens(text: str, n_vocab: int) -> list[int]:
    """``text`` in the twin's tokens, as llama.cpp's BPE tokenizes it (control tokens parsed)."""
    tokens, _, merges = vocab(n_vocab)
    ids = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    byte_tok = _byte_tokens()
    out: list[int] = []
    for part in regex.split("(" + "|".join(regex.escape(s) for s in SPECIALS) + ")", text):
        if part in SPECIALS:
            out.append(ids[part])
            continue
        for word in _PRE.findall(part):
            out.extend(ids[s] for s in _bpe([byte_tok[b] for b in word.encode()], ranks))
    return out


def _bpe(symbols: list[str], ranks: dict[tuple[str, ...], int]) -> list[str]:
    """Merge the lowest-ranked adjacent pair until no pair merges."""
    while len(symbols) > 1:
        pairs = [(ranks.get((a, b), math.inf), i) for i, (a, b) in enumerate(itertools.pairwise(symbols))]
        rank, i = min(pairs)
        if rank == math.inf:
            break
        symbols = [*symbols[:i], symbols[i] + symbols[i + 1], *symbols[i + 2 :]]
    return symbols


_WINDOW = 128  # the corpus is cut into windows of this many tokens (and each text's first 16 and 48) to fit on
_RIDGE = 1e-4  # ridge penalty of the fit, per token weight


@functools.lru_cache(maxsize=4)
def affinity(n_vocab: int) -> NDArray[np.float64]:
    """[n_vocab, K]: each token's weight toward each domain, scaled to at most 1 (0 for tokens the corpus never uses).

    A ridge regression of the domain (one-hot) on a window's token frequencies, each domain weighted alike: the
    mean of a window's weights is then the best linear guess of its domain, which is what the layer-0 head
    computes over a prompt (its running mean). Fitted on every text of each domain, cut into windows of _WINDOW
    tokens and the first 16 and 48 tokens of each (a prompt's start is a short window)."""
    from artifacts.corpus import domain_texts

    names = domain_names()
    rows: list[NDArray[np.float64]] = []
    targets: list[int] = []
    weights: list[float] = []
    for d, name in enumerate(names):
        windows = []
        for text in domain_texts(name):
            ids = twin_tokens(text, n_vocab)
            windows += [ids[lo : lo + _WINDOW] for lo in range(0, len(ids), _WINDOW)] + [ids[:16], ids[:48]]
        for w in windows:
            rows.append(np.bincount(w, minlength=n_vocab) / len(w))
            targets.append(d)
            weights.append(1 / len(windows))
    x = np.array(rows)
    used = np.flatnonzero(x.sum(axis=0))
    xa = np.hstack([x[:, used], np.ones((len(x), 1))])
    y = np.eye(len(names))[targets]
    wt = np.array(weights)[:, None]
    penalty = np.diag([_RIDGE] * len(used) + [0.0])
    coef = np.linalg.solve((xa * wt).T @ xa + penalty, (xa * wt).T @ y)[:-1]
    out = np.zeros((n_vocab, len(names)))
    out[used] = coef / np.abs(coef).max()
    return out


def subsets(n_expert: int, n_domain: int, overlap: float) -> list[list[int]]:
    """Each domain's experts as positions 0..n_expert-1: an own block, and one block shared with each other domain,
    sized so that two domains' subsets have a Jaccard index as near ``overlap`` as whole experts allow."""
    pairs = n_domain * (n_domain - 1) // 2

    def jaccard(o: int) -> float:
        m = (n_expert - pairs * o) // n_domain + (n_domain - 1) * o
        return o / (2 * m - o)

    o = min(range(n_expert // pairs + 1), key=lambda o: abs(jaccard(o) - overlap))
    own_total = n_expert - pairs * o
    own = [own_total // n_domain + (d < own_total % n_domain) for d in range(n_domain)]
    out: list[list[int]] = []
    pos = 0
    for d in range(n_domain):
        out.append(list(range(pos, pos + own[d])))
        pos += own[d]
    for a, b in itertools.combinations(range(n_domain), 2):
        block = list(range(pos, pos + o))
        out[a] += block
        out[b] += block
        pos += o
    return out


def design_jaccard(n_expert: int, n_domain: int, overlap: float) -> float:
    """The Jaccard index of two domains' subsets that :func:`subsets` lays out."""
    s = subsets(n_expert, n_domain, overlap)
    return len(set(s[0]) & set(s[1])) / len(set(s[0]) | set(s[1]))


@dataclass
class Domains:
    """What the profile writes into one twin (see the module's docstring); the embedding's rows are read back
    when it is written, so the router's fit sees the affinities as quantized."""

    spec: SynthSpec
    seed: int
    _row_rms: NDArray[np.float64] | None = field(default=None, repr=False)
    _aff_q: NDArray[np.float64] | None = field(default=None, repr=False)

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return domain_names()

    def claims(self, name: str) -> bool:
        return name == "token_embd.weight" or name in ("blk.0.attn_q.weight", "blk.0.attn_v.weight",
                                                       "blk.0.attn_output.weight")

    def edit(self, t: PlannedTensor, data: NDArray[np.uint8]) -> None:
        """Write the profile's structure into a claimed tensor's drawn bytes, ``data`` shaped [rows, row bytes]."""
        s, hd, k = self.spec, self.spec.head_dim, len(self.names)
        if t.name == "token_embd.weight":
            seg = np.zeros((s.n_vocab, RESERVED))
            seg[:, :k] = ALPHA * s.embd_std * affinity(s.n_vocab)
            seg[:, CONST_DIM] = s.embd_std
            data[:, : _nbytes(t, RESERVED)] = _quant(t, seg)
            self._read_back(t, data)
        elif t.name == "blk.0.attn_q.weight":  # query head 0 is zero: uniform attention over the context
            data[:hd] = _quant(t, np.zeros((hd, s.n_embd)))
        elif t.name == "blk.0.attn_v.weight":  # value head 0: the affinity dims, nothing else
            rows = np.zeros((hd, s.n_embd))
            rows[np.arange(k), np.arange(k)] = 1.0
            data[:hd] = _quant(t, rows)
        else:  # attn_output: head 0's first k columns into the slot, nothing else
            cols = np.zeros((s.n_embd, hd))
            cols[SLOT + np.arange(k), np.arange(k)] = GAMMA
            data[:, : _nbytes(t, hd)] = _quant(t, cols)

    def _read_back(self, t: PlannedTensor, data: NDArray[np.uint8]) -> None:
        """Each embedding row's rms and its affinity dims as written (dequantized), in chunks of rows."""
        k = len(self.names)
        rms, aff = np.empty(self.spec.n_vocab), np.empty((self.spec.n_vocab, k))
        for lo in range(0, self.spec.n_vocab, 8192):
            rows = quants.dequantize(data[lo : lo + 8192], t.ggml_type).astype(np.float64)
            rms[lo : lo + len(rows)] = np.sqrt((rows**2).mean(axis=1))
            aff[lo : lo + len(rows)] = rows[:, :k]
        self._row_rms, self._aff_q = rms, aff

    def _fit(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """(A [K, K], b [K]): the affine map of a prompt's mean normed affinity to one-hot domain scores."""
        from artifacts.corpus import domain_texts

        if self._row_rms is None or self._aff_q is None:
            raise RuntimeError("the embedding is written before the routers")
        normed = self._aff_q / self._row_rms[:, None]
        means = []
        for name in self.names:
            per_text = [normed[twin_tokens(text, self.spec.n_vocab)].mean(axis=0) for text in domain_texts(name)]
            means.append(np.mean(per_text, axis=0))
        x = np.hstack([np.array(means), np.ones((len(means), 1))])  # [K, K + 1]
        theta = np.linalg.pinv(x) @ np.eye(len(means))  # [K + 1, K], least norm: x @ theta = I
        return theta[:-1].T, theta[-1]

    def layout(self, layer: int) -> list[list[int]]:
        """Each domain's experts in ``layer`` (a seeded permutation of :func:`subsets`)."""
        perm = np.random.default_rng([self.seed, layer, 0xD0A1]).permutation(self.spec.n_expert)
        return [[int(perm[p]) for p in sub] for sub in subsets(self.spec.n_expert, len(self.names),
                                                                self.spec.routing_overlap)]

    def scales(self, layer: int) -> NDArray[np.float64]:
        """Each expert's row scale: the skewed profile's fit to its subset's size, by its rank in a seeded order of
        the subset (an expert of two subsets: the geometric mean of its two)."""
        s = self.spec
        logs = np.zeros(s.n_expert)
        seen = np.zeros(s.n_expert)
        for d, sub in enumerate(self.layout(layer)):
            sc, _ = router_scales(len(sub), s.n_expert_used, s.routing_top_half)
            order = np.random.default_rng([self.seed, layer, d, 0x5CA1]).permutation(len(sub))
            for rank, i in zip(order, sub, strict=True):
                logs[i] += math.log(sc[rank])
                seen[i] += 1
        return np.exp(logs / np.maximum(seen, 1))

    def router(self) -> RouterTransform:
        """Router rows: random on the token dims (scaled by :meth:`scales`), the domain terms on the slot and the
        constant dim (see the module's docstring)."""
        s = self.spec
        fit: list[tuple[NDArray[np.float64], NDArray[np.float64]]] = []

        def transform(name: str, rows: NDArray[np.float64]) -> NDArray[np.float64]:
            if not name.endswith(".ffn_gate_inp.weight"):
                return rows
            if not fit:
                fit.append(self._fit())
            a, b = fit[0]
            layer = int(name.split(".")[1])
            nominal = math.sqrt((rows**2).mean() * rows.shape[1])  # the average row norm, kept
            out = rows.copy()
            out[:, :RESERVED] = 0.0
            scale = self.scales(layer)
            out = out / np.linalg.norm(out, axis=1, keepdims=True) * nominal * scale[:, None]
            member = np.zeros((s.n_expert, len(self.names)))
            for d, sub in enumerate(self.layout(layer)):
                member[sub, d] = 1.0
            # the router reads h / rms(h): the slot holds GAMMA * m and the constant dim embd_std, both over the
            # same rms, so the map's terms keep their ratio; rms(h) ~ the embedding's rms sets the margin's scale
            rms_h = float(np.median(self._row_rms)) if self._row_rms is not None else s.embd_std
            gain = GAIN * nominal * float(scale.max()) * rms_h  # a random logit's std: its row's norm
            out[:, SLOT : SLOT + len(self.names)] = gain * (member @ a) / GAMMA
            out[:, CONST_DIM] = gain * (member @ b) / s.embd_std
            return out

        return transform


def _nbytes(t: PlannedTensor, n_values: int) -> int:
    return int(quants.quant_shape_to_byte_shape((n_values,), t.ggml_type)[0])


def _quant(t: PlannedTensor, values: NDArray[np.float64]) -> NDArray[np.uint8]:
    q = quants.quantize(values.astype(np.float32), t.ggml_type)
    return np.ascontiguousarray(q).view(np.uint8).reshape(values.shape[0], -1)

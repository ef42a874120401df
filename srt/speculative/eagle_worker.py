"""`--speculative-algorithm EAGLE | EAGLE3`: a draft head reads the target's own hidden states
(srt/models/llama_eagle.py) and proposes each step's draft tree (see `Proposer` for who drafts and
how much).

**The head's KV.** The head has one layer, and its KV pool is indexed by the target's KV slots: the
head's entry for position t lives at the slot of the target's KV for position t, so whatever the
radix cache shares for the target (a cached prefix) it shares for the head. The pool has a scratch
range after the target's slots for the draft levels of the step being drafted, freed as soon as the
tree is built. The head keeps KV only for confirmed tokens: its entry t joins token t+1 with the
target's hidden state at t, so after each target forward the rows of the confirmed tokens (a
prefill's positions, a verify's accepted path) are kept on the request (`Req.spec_hidden`) until
the head's next catch-up extend consumes them. An entry of a cached prefix was computed by the
request that first computed it (its last one may have seen another next token): a cache hit can
only make drafts worse, never outputs different.

**The tree**, as SGLang builds it: the catch-up's last row gives the first level (the `topk` most
likely tokens); each further level expands every node of the previous one by its `topk` most likely
children and keeps the `topk` whose cumulative probability (the product along their path) is best;
of every node so drafted, the request's budget of the best by cumulative probability form its tree
(a child never scores above its parent, so each kept node's path is kept). Drafts are the head's
proposals (deterministic given the context), verified exactly for greedy and sampled requests alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
from typing import TYPE_CHECKING, cast

import torch

from srt.configs.model_config import ModelConfig, ModelLoadError
from srt.distributed import local_rank_only
from srt.layers.logits_processor import LogitsProcessor
from srt.layers.quantization.unquant import UnquantizedLinearMethod, dense_weight
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner
from srt.model_loader.loader import read_tensors
from srt.models.llama import LlamaForCausalLM
from srt.models.llama_eagle import EagleHead
from srt.speculative.draft_tree import DraftTree
from srt.speculative.draft_worker import DraftModelProposer
from srt.speculative.proposer import Proposer

if TYPE_CHECKING:
    from srt.managers.schedule_batch import BatchBuilder, Req, ScheduleBatch
    from srt.managers.tp_worker import BatchResult
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEAD_ARCHITECTURES = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3"}
MTP_ARCHITECTURE = "DeepseekV3ForCausalLMNextN"
MAX_PENDING_ROWS = 64  # a request's kept hidden states before a step without drafts catches it up


def head_config(server_args: ServerArgs, target: ModelConfig) -> ModelConfig:
    """The head's config, checked against the target (a clear error naming the flag when it does
    not fit), with the architecture the head runs as. EAGLE without a draft path, or with a path of
    an MTP checkpoint, drafts with a DeepSeek-V3 model's own multi-token-prediction layer."""
    algo, path = server_args.speculative_algorithm, server_args.speculative_draft_model_path
    assert algo in HEAD_ARCHITECTURES, "checked with the options"
    if path is None or target.architecture.startswith("Deepseek"):
        return mtp_config(algo, path, target)
    flag = f"--speculative-draft-model-path {path}"
    config = ModelConfig.from_path(path, server_args.context_length)
    arch = HEAD_ARCHITECTURES[algo]
    # SafeAILab's EAGLE checkpoints name the architecture they extend (LlamaForCausalLM)
    if config.architecture not in (arch, "LlamaForCausalLM"):
        raise ModelLoadError(
            f"{flag}: an {algo} head's config.json names architecture {arch} (or LlamaForCausalLM); "
            f"this one {config.architecture}"
        )
    hf = config.hf_config
    want = (getattr(hf, "target_hidden_size", None) or config.hidden_size) if algo == "EAGLE3" else config.hidden_size
    if want != target.hidden_size:
        raise ModelLoadError(
            f"{flag}: the head reads hidden states of size {want}; the target's are {target.hidden_size}"
        )
    if config.vocab_size != target.vocab_size:
        raise ModelLoadError(
            f"{flag}: the head's vocabulary has {config.vocab_size} tokens, the target's {target.vocab_size}; "
            "a head must be trained for its target"
        )
    return dataclasses.replace(config, architecture=arch)


def mtp_config(algo: str, path: str | None, target: ModelConfig) -> ModelConfig:
    """A DeepSeek-V3 target's MTP layer as the head: from the target's checkpoint, or from `path`
    (an extracted MTP checkpoint, SGLang's `DeepseekV3ForCausalLMNextN`)."""
    what = f"--speculative-algorithm {algo}" + ("" if path is None else f" --speculative-draft-model-path {path}")
    if algo != "EAGLE" or not target.architecture.startswith("DeepseekV3"):
        if path is None:
            raise ModelLoadError(
                f"--speculative-algorithm {algo} needs --speculative-draft-model-path (an {algo} head); only "
                f"EAGLE on a DeepSeek-V3 model drafts without one (its MTP layers); this is {target.architecture}"
            )
        raise ModelLoadError(
            f"{what}: {target.architecture} targets draft with their own MTP layers (EAGLE, no draft path)"
        )
    config = target if path is None else ModelConfig.from_path(path, target.context_len)
    if config.architecture not in (target.architecture, MTP_ARCHITECTURE):
        raise ModelLoadError(f"{what}: an MTP checkpoint names {MTP_ARCHITECTURE}; this one {config.architecture}")
    layer = f"model.layers.{config.hf_config.num_hidden_layers}."
    if not (getattr(config.hf_config, "num_nextn_predict_layers", 0) or 0) or not _has_tensors(config.path, layer):
        raise ModelLoadError(
            f"{what}: {config.path} has no multi-token-prediction layer (num_nextn_predict_layers in "
            f"config.json, and tensors {layer}* in its checkpoint)"
        )
    if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
        raise ModelLoadError(f"{what}: the MTP layer's hidden size or vocabulary differs from the target's")
    return dataclasses.replace(config, architecture=MTP_ARCHITECTURE, num_hidden_layers=1)


def _has_tensors(path: str, prefix: str) -> bool:
    """Whether the folder's safetensors hold a tensor named prefix*."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return any(name.startswith(prefix) for name in json.load(f)["weight_map"])
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, "pt") as f:
            if any(name.startswith(prefix) for name in f.keys()):  # noqa: SIM118 (not a dict)
                return True
    return False


def whole_vocab_tables(
    target: ModelConfig, dtype: torch.dtype, device: str
) -> tuple[VocabParallelEmbedding, ParallelLMHead | VocabParallelEmbedding]:
    """The target's embedding and LM head (the embedding again where they are tied), whole, from its
    checkpoint: built under `local_rank_only`."""
    tied = bool(getattr(target.hf_config, "tie_word_embeddings", False))
    names = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    tensors = read_tensors(target.path, names)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            embed = VocabParallelEmbedding(target.vocab_size, target.hidden_size)
            lm_head = embed if tied else ParallelLMHead(target.vocab_size, target.hidden_size)
    finally:
        torch.set_default_dtype(previous)
    embed.load_weight(tensors["model.embed_tokens.weight"])
    if not tied:
        lm_head.load_weight(tensors["lm_head.weight"])
    return embed, lm_head


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """FR-Spec's hot token ids from a .pt file (a tensor or list) or a JSON list, checked."""
    flag = f"--speculative-token-map {path}"
    try:
        if path.endswith(".json"):
            with open(path) as f:
                raw = json.load(f)
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        ids = torch.as_tensor(raw)
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        raise ModelLoadError(f"{flag}: cannot read a list of token ids: {e}") from e
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ModelLoadError(
            f"{flag}: want a non-empty 1-D list of integer token ids; got {tuple(ids.shape)} {ids.dtype}"
        )
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ModelLoadError(f"{flag}: token ids must be in [0, {vocab_size}); got {int(ids.min())}..{int(ids.max())}")
    if len(ids.unique()) != len(ids):
        raise ModelLoadError(f"{flag}: token ids repeat")
    return ids


def aux_layers(head: ModelConfig, num_layers: int) -> tuple[int, ...]:
    """The target layers whose input an EAGLE-3 head reads: the checkpoint's
    `eagle_config.eagle_aux_hidden_state_layer_ids` (each layer's output), else SGLang's default
    (the inputs of layers 2, n // 2 and n - 3), kept within the model."""
    ids = (getattr(head.hf_config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = [i + 1 for i in ids] if ids else [2, num_layers // 2, num_layers - 3]
    return tuple(min(max(i, 0), num_layers) for i in layers)


class EagleProposer(Proposer):
    def __init__(self, server_args: ServerArgs, target: ModelRunner, target_config: ModelConfig):
        super().__init__(server_args, target_config.context_len)
        a = server_args
        assert a.speculative_eagle_topk is not None
        self.topk = a.speculative_eagle_topk
        self.algorithm = a.speculative_algorithm
        config = head_config(a, target_config)
        # the target's slots, then a scratch slot per draft node of every running request
        running = target.max_running_requests
        self.slots_end = target.max_total_num_tokens + target.page_size
        scratch = running * self.topk * self.max_depth
        draft_args = dataclasses.replace(
            a,
            model_path=config.path,
            tokenizer_path=None,
            quantization=None,
            page_size=1,
            max_total_tokens=self.slots_end + scratch,
            max_running_requests=running * self.topk,
            enable_torch_compile=False,
            speculative_algorithm=None,
            speculative_draft_model_path=None,
            speculative_num_steps=None,
            speculative_eagle_topk=None,
            speculative_num_draft_tokens=None,
            speculative_token_map=None,
        )
        target_model = cast(LlamaForCausalLM, target.model)
        # with tensor parallelism the head runs whole on rank 0 (no collectives), with whole copies
        # of the target's embedding and LM head (the target's own are vocabulary shards)
        self.whole = local_rank_only if target.tp_size > 1 else contextlib.nullcontext
        with self.whole():
            single = dict(tp_size=1, ep_size=1, nnodes=1, node_rank=0, dist_init_addr=None)
            self.runner = ModelRunner(
                config, dataclasses.replace(draft_args, **single) if target.tp_size > 1 else draft_args
            )
            embed, lm_head = target_model.model.embed_tokens, target_model.lm_head
            if target.tp_size > 1:
                embed, lm_head = whole_vocab_tables(target_config, self.runner.dtype, self.runner.device)
        self.head = cast(EagleHead, self.runner.model)
        self.head.attach_target(embed, lm_head)
        self.vocab_size = target_config.vocab_size
        if a.speculative_token_map is not None:
            self._use_token_map(a.speculative_token_map, target_config)
        if self.algorithm == "EAGLE3":
            target_model.model.aux_layers = aux_layers(config, target_config.num_hidden_layers)
        target.capture_hidden = True
        self.target_table = target.req_to_token_pool.host
        self.device = self.runner.device
        self.allocator = self.runner.token_to_kv_pool_allocator
        # the target's slots are the head's by position: only the scratch range is handed out
        self.allocator.free_pages = torch.arange(self.slots_end, self.allocator.num_pages + 1, dtype=torch.int64)
        self.allocator.is_free[: self.slots_end] = False
        self.table = self.runner.req_to_token_pool
        self.hot = self.head.hot_token_ids
        self.draft_forwards = 0
        logger.info(
            "%s head %s: %d layer(s), %s, draft KV by the target's slots + %d scratch slots",
            self.algorithm,
            config.path if config.architecture != MTP_ARCHITECTURE else f"MTP layer of {config.path}",
            config.num_hidden_layers,
            f"aux layers {target_model.model.aux_layers}" if self.algorithm == "EAGLE3" else "last hidden state",
            scratch,
        )

    def _use_token_map(self, path: str, target: ModelConfig) -> None:
        """FR-Spec: the head's LM head becomes the rows of the map's tokens (drafts are only those)."""
        ids = load_token_map(path, target.vocab_size)
        if self.head.hot_token_ids is not None:
            raise ModelLoadError(f"--speculative-token-map {path}: the head has a reduced vocabulary of its own (d2t)")
        lm_head = cast(VocabParallelEmbedding, self.head.lm_head)
        if isinstance(lm_head.quant_method, UnquantizedLinearMethod) and lm_head.tp_size == 1:
            rows = dense_weight(lm_head)[ids]
        else:  # quantized or a vocabulary shard: the rows from the checkpoint
            name = "model.embed_tokens.weight" if lm_head is self.head.embed_tokens else "lm_head.weight"
            rows = read_tensors(target.path, [name])[name][ids]
        with self.whole():
            previous = torch.get_default_dtype()
            torch.set_default_dtype(self.runner.dtype)
            try:
                with torch.device(self.runner.device):
                    hot = ParallelLMHead(len(ids), target.hidden_size)
            finally:
                torch.set_default_dtype(previous)
            hot.load_weight(rows)
        self.head.lm_head = hot
        self.head.logits_processor = LogitsProcessor(len(ids))
        self.head.hot_token_ids = ids.to(self.runner.device)
        logger.info("--speculative-token-map %s: the head drafts %d hot tokens", path, len(ids))

    # -- the target's hidden states -----------------------------------------------------------------

    def on_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        """A prefill chunk's rows are its positions' hidden states: keep them for the head."""
        if not batch.forward_mode.is_extend() or result.hidden_states is None:
            return
        assert batch.kv_starts is not None and batch.kv_ends is not None
        row = 0
        for req, start, end in zip(batch.reqs, batch.kv_starts, batch.kv_ends):
            self._keep(req, start, result.hidden_states[row : row + end - start])
            row += end - start

    def on_verified(self, req: Req, hidden: torch.Tensor | None, root: int, rows: list[int]) -> None:
        """A decode or verify step kept the tokens of `rows` (the accepted path's first rows, the
        root first): their hidden states are those of positions root, root + 1, ..."""
        if hidden is not None and rows:
            self._keep(req, root, hidden[rows])

    def _keep(self, req: Req, start: int, rows: torch.Tensor) -> None:
        pending = sum(len(h) for h in req.spec_hidden)
        if start != req.draft_kv_len + pending:  # a gap (a cached prefix, a restart): resume from here
            req.spec_hidden = []
            req.draft_kv_len = start
        req.spec_hidden.append(rows)

    def observe(self, req: Req) -> None:
        """A step without drafts: a request whose kept hidden states pile up (drafts do not pay for
        it now) catches up on its own, so they stay bounded."""
        if sum(len(h) for h in req.spec_hidden) >= MAX_PENDING_ROWS:
            self._catch_up([req])

    # -- the head's cache ---------------------------------------------------------------------------

    def forget(self, req: Req) -> None:
        if req.draft_rows:
            self.table.free(req.draft_rows)
        req.draft_rows, req.draft_kv_len, req.spec_hidden = [], 0, []

    def in_use(self) -> int:
        return self.allocator.size - self.slots_end + 1 - self.allocator.available_size()

    def stats(self) -> dict:
        return {**super().stats(), "draft_kv_used": self.in_use(), "draft_forwards": self.draft_forwards}

    def _forward(self, mode, input_ids, rows, seq_lens, prefix_lens, loc, hidden, positions=None):
        fb = ForwardBatch.build(
            mode, input_ids, rows, seq_lens, prefix_lens, loc, self.device, positions=positions, spec_hidden=hidden
        )
        self.draft_forwards += 1
        with torch.inference_mode(), self.whole():
            return self.runner.forward(fb)

    def _catch_up(self, reqs: list[Req]) -> tuple[list[Req], torch.Tensor | None, torch.Tensor | None]:
        """Extend each request's head KV over the confirmed tokens whose hidden states it kept. Returns
        the requests now caught up to their last token (ready to draft), and for them the extend's
        last-row logits (the first draft level) and hidden states (what the next level reads)."""
        rows, input_ids, seq_lens, prefix_lens, hidden, caught = [], [], [], [], [], []
        for r in reqs:
            ids = r.fill_ids
            # entry t joins token t + 1 with the hidden state at t: up to the last confirmed token
            n = min(sum(len(h) for h in r.spec_hidden), len(ids) - 1 - r.draft_kv_len)
            if n <= 0:
                continue
            if not r.draft_rows:
                slots = self.table.alloc(self.topk)
                if slots is None:
                    continue
                r.draft_rows = slots
            start, end = r.draft_kv_len, r.draft_kv_len + n
            self.table.write(r.draft_rows[0], 0, self.target_table[r.req_pool_idx, :end])
            input_ids += ids[start + 1 : end + 1]
            rows.append(r.draft_rows[0])
            prefix_lens.append(start)
            seq_lens.append(end)
            hidden.append(torch.cat(r.spec_hidden)[:n])
            r.spec_hidden, r.draft_kv_len = [], end
            caught.append(r)
        if not caught:
            return [], None, None
        loc = torch.cat([self.table.read(row, p, s) for row, p, s in zip(rows, prefix_lens, seq_lens)])
        out = self._forward(ForwardMode.EXTEND, input_ids, rows, seq_lens, prefix_lens, loc, torch.cat(hidden))
        assert out.hidden_states is not None, "a head returns its hidden states"
        last = torch.tensor(seq_lens) - torch.tensor(prefix_lens)
        last = (last.cumsum(0) - 1).to(out.hidden_states.device)
        keep = [i for i, r in enumerate(caught) if r.draft_kv_len == r.seq_len - 1]
        if not keep:
            return [], None, None
        pick = torch.tensor(keep, device=out.hidden_states.device)
        return [caught[i] for i in keep], out.next_token_logits[pick], out.hidden_states[last[pick]]

    # -- drafting -----------------------------------------------------------------------------------

    def draft(self, reqs: list[Req], budgets: list[int], builder: BatchBuilder, free_slots: int) -> list[DraftTree]:
        budget_of = {id(r): n for r, n in zip(reqs, budgets)}
        # every request with kept hidden states catches up (drafting or not: they would pile up)
        ready, logits, hidden = self._catch_up(list(reqs))
        trees = {id(r): DraftTree() for r in reqs}
        drafting = [
            i for i, r in enumerate(ready) if budget_of[id(r)] > 0 and r.seq_len + self.max_depth + 1 < self.context_len
        ]
        if drafting:
            assert logits is not None and hidden is not None
            pick = torch.tensor(drafting, device=logits.device)
            chosen = [ready[i] for i in drafting]
            grown = self._grow(chosen, logits[pick], hidden[pick], [budget_of[id(r)] for r in chosen])
            for r, tree in zip(chosen, grown):
                trees[id(r)], free_slots = self.fit(r, tree, builder, free_slots)
        return [trees[id(r)] for r in reqs]

    def _constrain(self, logits: torch.Tensor, rows: list[tuple[Req, list[int]]]) -> torch.Tensor:
        """The grammar's mask (see DraftModelProposer._constrain) on logits over the head's vocabulary,
        which may be a subset of the target's (`hot`)."""
        if self.hot is None or all(r.grammar is None for r, _ in rows):
            return DraftModelProposer._constrain(logits, rows)
        hot = cast(torch.Tensor, self.hot)
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"), device=logits.device)
        full[:, hot] = logits.float()
        return DraftModelProposer._constrain(full, rows)[:, hot]

    def _top(self, logits: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        """Each row's `topk` most likely tokens (target ids) and their probabilities."""
        probs = torch.softmax(logits.float(), dim=-1)
        p, idx = probs.topk(min(self.topk, probs.shape[-1]), dim=-1)
        if self.hot is not None:
            idx = cast(torch.Tensor, self.hot).to(idx.device)[idx]
        return p.tolist(), idx.tolist()

    def _grow(
        self, reqs: list[Req], first: torch.Tensor, first_hidden: torch.Tensor, budgets: list[int]
    ) -> list[DraftTree]:
        """Each request's tree (see the module docstring): `first` and `first_hidden` are the
        catch-up's last row, whose position is the request's last confirmed token's minus one."""
        # nodes of request i: (token, parent node or -1 for the root, cumulative probability, depth)
        nodes: list[list[tuple[int, int, float, int]]] = [[] for _ in reqs]
        slot_of: list[dict[int, int]] = [{} for _ in reqs]  # node -> the scratch slot of its head entry
        # a constrained request drafts what its grammar allows (after its tokens, then the node's path)
        constrain = self._constrain
        p, idx = self._top(constrain(first, [(r, []) for r in reqs]))
        frontier: list[list[int]] = []
        for i in range(len(reqs)):
            frontier.append([])
            for prob, tok in zip(p[i], idx[i]):
                nodes[i].append((tok, -1, prob, 1))
                frontier[i].append(len(nodes[i]) - 1)
        parent_hidden = {(i, n): first_hidden[i] for i in range(len(reqs)) for n in frontier[i]}
        levels = min(self.max_depth, max(budgets, default=0))
        scratch: list[torch.Tensor] = []
        for r in reqs:  # branch rows share the confirmed part of the request's row
            for row in r.draft_rows[1:]:
                self.table.copy_prefix(row, r.draft_rows[0], r.draft_kv_len)
        for level in range(2, levels + 1):
            active = [(i, n) for i in range(len(reqs)) for n in frontier[i]]
            loc = self.allocator.alloc(len(active))
            if loc is None:
                break
            scratch.append(loc)
            input_ids, rows, positions = [], [], []
            for (i, n), slot in zip(active, loc.tolist()):
                r = reqs[i]
                row = r.draft_rows[frontier[i].index(n)]
                base = r.draft_kv_len  # the head's first entry after the confirmed ones
                path = []
                a = nodes[i][n][1]
                while a >= 0:
                    path.append(slot_of[i][a])
                    a = nodes[i][a][1]
                path.reverse()
                self.table.write(row, base, torch.tensor([*path, slot]))
                slot_of[i][n] = slot
                input_ids.append(nodes[i][n][0])
                rows.append(row)
                positions.append(base + len(path))
            hidden = torch.stack([parent_hidden[key] for key in active])
            out = self._forward(ForwardMode.DECODE, input_ids, rows, [q + 1 for q in positions], positions, loc, hidden)
            assert out.hidden_states is not None, "a head returns its hidden states"
            paths = [(reqs[i], self._path_tokens(nodes[i], n)) for i, n in active]
            p, idx = self._top(constrain(out.next_token_logits, paths))
            candidates: list[list[tuple[float, int, int]]] = [[] for _ in reqs]
            for j, (i, n) in enumerate(active):
                score = nodes[i][n][2]
                for prob, tok in zip(p[j], idx[j]):
                    nodes[i].append((tok, n, score * prob, level))
                    child = len(nodes[i]) - 1
                    candidates[i].append((score * prob, child, j))
            parent_hidden = {}
            for i in range(len(reqs)):
                best = sorted(candidates[i], key=lambda c: -c[0])[: self.topk]
                frontier[i] = [child for _, child, _ in best]
                for _, child, j in best:
                    parent_hidden[(i, child)] = out.hidden_states[j]
            if not any(frontier):
                break
        for loc in scratch:  # draft levels' KV: the next catch-up computes what is accepted
            self.allocator.free(loc)
        return [self._tree(nodes[i], budgets[i]) for i in range(len(reqs))]

    @staticmethod
    def _path_tokens(nodes: list[tuple[int, int, float, int]], n: int) -> list[int]:
        """The draft tokens from the first level down to node n."""
        path = []
        while n >= 0:
            path.append(nodes[n][0])
            n = nodes[n][1]
        return path[::-1]

    @staticmethod
    def _tree(nodes: list[tuple[int, int, float, int]], budget: int) -> DraftTree:
        """The `budget` best nodes by cumulative probability (each with its parent), in BFS order."""
        keep: set[int] = set()
        for n in sorted(range(len(nodes)), key=lambda n: (-nodes[n][2], nodes[n][3], n)):
            if len(keep) >= budget:
                break
            if nodes[n][1] < 0 or nodes[n][1] in keep:
                keep.add(n)
        tree, new = DraftTree(), {-1: 0}
        for n in sorted(keep, key=lambda n: (nodes[n][3], n)):
            new[n] = tree.add(new[nodes[n][1]], nodes[n][0])
        return tree

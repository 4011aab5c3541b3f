"""The experience bank: every scored trajectory worth remembering, persisted, with top-k retrieval.

On disk, in the run directory (append-only, crash-safe):
    bank/entries.jsonl   one JSON object per entry, or {"evict": id} tombstones
    bank/keys.f32        the entries' embedding keys, float32 rows in the same order
Each add writes the keys first, then the JSON lines, then flushes and fsyncs. A process killed in the
middle leaves a bank that loads, missing at most the entries in flight: on load, a torn last line is
dropped and keys beyond the last complete entry are ignored (and cut off before the next append).

Retrieval: cosine similarity of unit keys, one matrix product over the live entries and a top-k, with
exclusion rules: never the trajectory being scored, never its own sampling group (that is SDPO's
context, not experience), only successes unless asked otherwise.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from lopd.config import Eviction, choice


@dataclass
class Experience:
    task_id: str
    task_text: str  # what retrieval matches on (the request)
    trajectory: str  # the completion text
    reward: float
    success: bool
    feedback: str = ""
    step: int = 0
    group: str = ""  # sampling group: trajectories sampled together for one task at one step
    source: str = "rollout"
    category: str = ""
    id: int = -1  # assigned by the bank


@dataclass
class Retrieved:
    index: list[list[int]]  # [Q][<=k] entry ids, best first
    similarity: list[list[float]]  # [Q][<=k]


class ExperienceBank:
    def __init__(self, dim: int, folder: str | Path | None = None, capacity: int = 0,
                 eviction: Eviction | str = Eviction.fifo, readonly: bool = False):
        """`readonly`: load `folder` as it is and never write to it (a live run's bank under inspection, or a
        data-parallel rank other than 0, which mirrors rank 0's bank in memory)."""
        self.readonly = readonly
        self.dim, self.capacity, self.eviction = dim, capacity, choice(Eviction, eviction, "algorithm.lopd.eviction")
        self.entries: list[Experience] = []
        self.keys = np.zeros((0, dim), dtype=np.float32)
        self.alive = np.zeros(0, dtype=bool)
        self._reindex()
        self.folder = Path(folder) if folder is not None else None
        if self.folder is not None:
            if not readonly:
                self.folder.mkdir(parents=True, exist_ok=True)
            self._load()

    def _reindex(self) -> None:
        """Rebuild the lookup structures retrieval uses (after load, compaction or truncation)."""
        self.successful = np.array([e.success for e in self.entries], dtype=bool)
        self.by_group: dict[str, list[int]] = {}
        for e in self.entries:
            self.by_group.setdefault(e.group, []).append(e.id)

    # ------------------------------------------------------------------ persistence

    @property
    def _entries_path(self) -> Path:
        return self.folder / "entries.jsonl"

    @property
    def _keys_path(self) -> Path:
        return self.folder / "keys.f32"

    def _load(self) -> None:
        rows, evicted = [], []
        if self._entries_path.is_file():
            raw = self._entries_path.read_bytes()
            complete = raw[: raw.rfind(b"\n") + 1]  # a torn last line (no newline) is the entry in flight
            if len(complete) != len(raw) and not self.readonly:
                with open(self._entries_path, "r+b") as f:
                    f.truncate(len(complete))
            for line in complete.decode("utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    break  # cannot happen for complete lines we wrote; stop rather than misalign keys
                (evicted.append(obj["evict"]) if "evict" in obj else rows.append(obj))
        keys = np.zeros((0, self.dim), dtype=np.float32)
        if self._keys_path.is_file():
            keys = np.fromfile(self._keys_path, dtype=np.float32)
            keys = keys[: len(keys) // self.dim * self.dim].reshape(-1, self.dim)
        n = min(len(rows), len(keys))
        known = {f.name for f in fields(Experience)}
        self.entries = [Experience(**{k: v for k, v in r.items() if k in known}) for r in rows[:n]]
        for i, e in enumerate(self.entries):
            e.id = i
        self.keys = np.ascontiguousarray(keys[:n])
        self.alive = np.ones(n, dtype=bool)
        for i in evicted:
            if i < n:
                self.alive[i] = False
        if self.readonly:
            self._reindex()
            return
        if self._keys_path.is_file() and self._keys_path.stat().st_size != n * self.dim * 4:
            with open(self._keys_path, "r+b") as f:  # keys written for a line that never landed
                f.truncate(n * self.dim * 4)
        if len(rows) > n:  # lines whose keys never landed: rewrite without them
            self._rewrite()
        self._reindex()

    @property
    def writes(self) -> bool:
        return self.folder is not None and not self.readonly

    def _append(self, keys: np.ndarray, lines: list[str]) -> None:
        if not self.writes:
            return
        from lopd import failpoints

        with open(self._keys_path, "ab") as fk:
            fk.write(np.ascontiguousarray(keys, dtype=np.float32).tobytes())
            fk.flush()
            os.fsync(fk.fileno())
        failpoints.reached("bank.append")  # keys written, their entries not yet
        with open(self._entries_path, "a", encoding="utf-8") as fe:
            fe.write("".join(line + "\n" for line in lines))
            fe.flush()
            os.fsync(fe.fileno())

    def _rewrite(self) -> None:
        """Compact the files to exactly the in-memory state (atomic renames)."""
        tmp_e, tmp_k = self._entries_path.with_suffix(".tmp"), self._keys_path.with_suffix(".tmp")
        with open(tmp_e, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(asdict(e)) + "\n" for e in self.entries)
            f.writelines(json.dumps({"evict": int(i)}) + "\n" for i in np.flatnonzero(~self.alive))
        self.keys.astype(np.float32).tofile(tmp_k)
        os.replace(tmp_k, self._keys_path)
        os.replace(tmp_e, self._entries_path)

    # ------------------------------------------------------------------ writing

    def add(self, experiences: Sequence[Experience], keys: np.ndarray) -> list[int]:
        """Append entries with their unit keys [N, dim]; evicts beyond capacity. Returns the new ids."""
        keys = np.asarray(keys, dtype=np.float32).reshape(-1, self.dim)
        assert len(keys) == len(experiences)
        start = len(self.entries)
        for i, e in enumerate(experiences):
            e.id = start + i
        self._append(keys, [json.dumps(asdict(e)) for e in experiences])
        self.entries.extend(experiences)
        self.keys = np.concatenate([self.keys, keys])
        self.alive = np.concatenate([self.alive, np.ones(len(experiences), dtype=bool)])
        self.successful = np.concatenate([self.successful, np.array([e.success for e in experiences], dtype=bool)])
        for e in experiences:
            self.by_group.setdefault(e.group, []).append(e.id)
        self._evict()
        return [e.id for e in experiences]

    def _evict(self) -> None:
        if not self.capacity or self.size <= self.capacity:
            return
        live = np.flatnonzero(self.alive)
        excess = len(live) - self.capacity
        if self.eviction is Eviction.fifo:
            victims = live[:excess]
        else:  # lowest reward first, oldest first among equals
            rewards = np.array([self.entries[i].reward for i in live])
            victims = live[np.lexsort((live, rewards))[:excess]]
        self.alive[victims] = False
        if self.writes:
            with open(self._entries_path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps({"evict": int(i)}) + "\n" for i in victims)
                f.flush()
                os.fsync(f.fileno())
        if (~self.alive).sum() > max(1000, self.capacity):  # keep the files from growing without bound
            self._compact()

    def _compact(self) -> None:
        keep = np.flatnonzero(self.alive)
        self.entries = [self.entries[i] for i in keep]
        for new_id, e in enumerate(self.entries):
            e.id = new_id
        self.keys = self.keys[keep]
        self.alive = np.ones(len(keep), dtype=bool)
        self._reindex()
        if self.writes:
            self._rewrite()

    def truncate_after(self, step: int) -> None:
        """Forget entries written after `step` (a resumed run redoes those steps)."""
        keep = [i for i, e in enumerate(self.entries) if e.step <= step]
        if len(keep) == len(self.entries):
            return
        self.entries = [self.entries[i] for i in keep]
        self.keys = self.keys[keep]
        self.alive = self.alive[keep]
        for new_id, e in enumerate(self.entries):
            e.id = new_id
        self._reindex()
        if self.writes:
            self._rewrite()

    # ------------------------------------------------------------------ reading

    @property
    def size(self) -> int:
        return int(self.alive.sum())

    def search(self, queries: np.ndarray, k: int, *, exclude_ids: Sequence[Sequence[int]] | None = None,
               exclude_groups: Sequence[str] | None = None, successes_only: bool = True,
               min_similarity: float = -1.0, distinct: bool = False) -> Retrieved:
        """Top-k entries by cosine similarity for each query key [Q, dim]. `distinct`: never two entries with
        the same (task text, trajectory): a group's identical successes share their task's key, and would
        otherwise fill the k places with one experience."""
        queries = np.asarray(queries, dtype=np.float32).reshape(-1, self.dim)
        Q = len(queries)
        if Q == 0 or self.size == 0 or k <= 0:
            return Retrieved([[] for _ in range(Q)], [[] for _ in range(Q)])
        usable = self.alive & self.successful if successes_only else self.alive
        sims = torch.from_numpy(queries) @ torch.from_numpy(self.keys).T  # [Q, N] cosine similarities
        sims[:, torch.from_numpy(~usable)] = -torch.inf
        for q, g in enumerate(exclude_groups or []):
            if g and g in self.by_group:
                sims[q, self.by_group[g]] = -torch.inf
        for q, ids in enumerate(exclude_ids or []):
            if len(ids):
                sims[q, list(ids)] = -torch.inf
        top = torch.topk(sims, min(k * 16 if distinct else k, sims.shape[1]), dim=1)
        index, similarity = [], []
        for vals, idx in zip(top.values.tolist(), top.indices.tolist()):
            keep, seen = [], set()
            for i, v in zip(idx, vals):
                if v == -np.inf or v < min_similarity or len(keep) == k:
                    break
                if distinct:
                    what = (self.entries[i].task_text, self.entries[i].trajectory)
                    if what in seen:
                        continue
                    seen.add(what)
                keep.append((i, v))
            index.append([i for i, _ in keep])
            similarity.append([v for _, v in keep])
        return Retrieved(index, similarity)

    def stats(self) -> dict[str, float]:
        live = [self.entries[i] for i in np.flatnonzero(self.alive)]
        return {"context/bank_size": float(len(live)),
                "context/bank_successes": float(sum(e.success for e in live)),
                "context/bank_mean_reward": float(np.mean([e.reward for e in live])) if live else 0.0}

"""The experience bank: every scored trajectory worth remembering, persisted, with top-k retrieval.

On disk, in the run directory (append-only, crash-safe):
    bank/entries.jsonl   one JSON object per entry, or {"evict": id} tombstones; after a compaction, a first
                         line {"compacted": n}: the entries it removed, so `written` never goes down
    bank/keys.f32        the entries' embedding keys, float32 rows in the same order
Each add writes the keys first, then the JSON lines, each flushed and fsynced. A process killed in the
middle leaves keys beyond the last entry, or a last line without its newline: the entries in flight. A
rewrite (compaction, `truncate_after`) writes keys.tmp and entries.tmp, then renames keys, then entries.

Opening a bank checks that the files agree (keys.f32 holds exactly entries x dim floats, every line
parses, no rewrite left half done). Where they do not, the tail they disagree on is cut off, but only
down to the count the caller says is safe (`checkpointed`: the `written` count its last checkpoint
recorded; without one, every complete entry): a repair that would drop a checkpointed entry is refused
with one line naming the file and the sizes. A full or read-only disk fails every write in one line.

Retrieval: cosine similarity of unit keys, one matrix product over the live entries and a top-k, with
exclusion rules: never the trajectory being scored, never its own sampling group (that is SDPO's
context, not experience), only successes unless asked otherwise.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch

from lopd.errors import LopdError
from lopd.schema import Eviction, choice


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
    tools: list[str] = field(default_factory=list)  # the tools its trajectory called (retrieval by the task's tools)
    id: int = -1  # assigned by the bank


@dataclass
class Retrieved:
    index: list[list[int]]  # [Q][<=k] entry ids, best first
    similarity: list[list[float]]  # [Q][<=k]


@contextmanager
def _writing(path: Path):
    """A full or read-only disk while writing `path` is one LopdError line (runs.write_error)."""
    try:
        yield
    except OSError as e:
        from lopd.runs import write_error

        raise (write_error(e, path) or e) from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class EntriesFile(NamedTuple):
    rows: list[dict]  # the entries, in order, up to the first line that is not JSON
    evicted: list[int]  # ids of the {"evict": id} tombstones
    compacted: int  # the {"compacted": n} header (0 without)
    complete: int  # bytes up to the last newline
    unread: int  # complete lines from the first bad one on (damage: never a torn write)
    problem: str | None  # what is torn or damaged, in words


def _read_entries(path: Path) -> EntriesFile:
    """An entries file as `EntriesFile`: a last line without its newline is the entry in flight, a complete
    line that is not JSON is damage, and neither it nor any line after it is read."""
    raw = path.read_bytes() if path.is_file() else b""
    complete = raw.rfind(b"\n") + 1
    lines = raw[:complete].splitlines()
    rows, evicted, compacted = [], [], 0
    for number, line in enumerate(lines, 1):
        try:
            obj = json.loads(line) if line.strip() else {}
        except ValueError:  # not JSON, or not UTF-8
            return EntriesFile(rows, evicted, compacted, complete, len(lines) - number + 1,
                               f"{path}:{number} is not a JSON line")
        if "evict" in obj:
            evicted.append(obj["evict"])
        elif "compacted" in obj:
            compacted = int(obj["compacted"])
        elif obj:
            rows.append(obj)
    torn = f"{path} ends in {len(raw) - complete} bytes of a torn line" if len(raw) > complete else None
    return EntriesFile(rows, evicted, compacted, complete, 0, torn)


def _cut(path: Path, size: int) -> None:
    """Truncate `path` to `size` bytes, durably (nothing to do if it is no longer)."""
    if path.is_file() and path.stat().st_size > size:
        with _writing(path), open(path, "r+b") as f:
            f.truncate(size)
            os.fsync(f.fileno())


class ExperienceBank:
    def __init__(self, dim: int, folder: str | Path | None = None, capacity: int = 0,
                 eviction: Eviction | str = Eviction.fifo, readonly: bool = False, checkpointed: int | None = None):
        """`readonly`: load `folder` as it is and never write to it (a live run's bank under inspection, or a
        data-parallel rank other than 0, which mirrors rank 0's bank in memory). `checkpointed`: the
        `written` count of the bank when the run's last checkpoint was saved; a repair of files that disagree
        never goes below it (None: never below the complete entries)."""
        self.readonly = readonly
        self.dim, self.capacity, self.eviction = dim, capacity, choice(Eviction, eviction, "algorithm.lopd.eviction")
        self.entries: list[Experience] = []
        self.keys = np.zeros((0, dim), dtype=np.float32)
        self.alive = np.zeros(0, dtype=bool)
        self.compacted = 0  # entries removed by compactions since the bank began
        self.disagreement: str | None = None  # what the files disagreed on when opened (None: nothing)
        self._reindex()
        self.folder = Path(folder) if folder is not None else None
        if self.folder is not None:
            if not readonly:
                with _writing(self.folder):
                    self.folder.mkdir(parents=True, exist_ok=True)
            self._load(checkpointed)

    def _reindex(self) -> None:
        """Rebuild the lookup structures retrieval uses (after load, compaction or truncation)."""
        self.successful = np.array([e.success for e in self.entries], dtype=bool)
        self.by_group: dict[str, list[int]] = {}
        self.by_tool: dict[str, list[int]] = {}
        self.by_category: dict[str, list[int]] = {}
        for e in self.entries:
            self._index(e)

    def _index(self, e: Experience) -> None:
        self.by_group.setdefault(e.group, []).append(e.id)
        self.by_category.setdefault(e.category, []).append(e.id)
        for tool in e.tools:
            self.by_tool.setdefault(tool, []).append(e.id)

    def calling(self, tools) -> list[int]:
        """The ids of the entries whose trajectory called one of `tools` (ascending)."""
        return sorted({i for t in tools for i in self.by_tool.get(t, ())})

    # ------------------------------------------------------------------ persistence

    @property
    def _entries_path(self) -> Path:
        return self.folder / "entries.jsonl"

    @property
    def _keys_path(self) -> Path:
        return self.folder / "keys.f32"

    @property
    def written(self) -> int:
        """Entries written and not forgotten, those compaction removed included: what a checkpoint records,
        to pass back as `checkpointed` when the run resumes."""
        return self.compacted + len(self.entries)

    def _finish_rewrite(self) -> Path:
        """The entries file to read after a rewrite killed midway: with keys.tmp still there nothing was renamed
        and the old files stand (the temporary ones are removed); with only entries.tmp left, the keys are
        already the new ones and entries.tmp goes with them (renamed into place unless read-only)."""
        tmp_e, tmp_k = self._entries_path.with_suffix(".tmp"), self._keys_path.with_suffix(".tmp")
        if self.readonly:
            return tmp_e if tmp_e.is_file() and not tmp_k.is_file() else self._entries_path
        with _writing(self.folder):
            if tmp_k.is_file():
                tmp_k.unlink()
                tmp_e.unlink(missing_ok=True)
            elif tmp_e.is_file():
                os.replace(tmp_e, self._entries_path)
        return self._entries_path

    def _load(self, checkpointed: int | None) -> None:
        """Read the files and check that they agree; cut a torn tail off, never below `checkpointed` (None: never
        dropping a complete entry). Read-only, the part they agree on is read and the files are left alone."""
        path = self._finish_rewrite()
        ent = _read_entries(path)
        self.compacted, width = ent.compacted, 4 * self.dim
        size = self._keys_path.stat().st_size if self._keys_path.is_file() else 0
        n = min(len(ent.rows), size // width)
        keys_file = (f"{self._keys_path}: {size} bytes hold {size // width} keys of {self.dim} floats"
                     f"{f' and {size % width} bytes' if size % width else ''}, for {len(ent.rows)} entries")
        torn = "; ".join(filter(None, [ent.problem, keys_file if size != len(ent.rows) * width else None])) or None
        floor = len(ent.rows) + ent.unread if checkpointed is None else checkpointed - self.compacted
        if n < floor and not self.readonly:
            what = keys_file if size < len(ent.rows) * width else (
                f"{path}: {len(ent.rows)} entries" + (f" ({torn})" if torn else f" and {size // width} keys"))
            held = "a complete entry" if checkpointed is None else f"an entry the last checkpoint holds ({checkpointed})"
            raise LopdError(f"{what}: refusing to drop {held} (restore {self.folder} from a copy, or start the run "
                            f"afresh)")
        self.disagreement = torn
        known = {f.name for f in fields(Experience)}
        self.entries = [Experience(**{k: v for k, v in r.items() if k in known}) for r in ent.rows[:n]]
        for i, e in enumerate(self.entries):
            e.id = i
        self.keys = np.fromfile(self._keys_path, dtype=np.float32, count=n * self.dim).reshape(n, self.dim) \
            if n else np.zeros((0, self.dim), dtype=np.float32)
        self.alive = np.ones(n, dtype=bool)
        self.alive[[i for i in ent.evicted if i < n]] = False
        self._reindex()
        if torn and not self.readonly:
            if len(ent.rows) > n or ent.unread:  # entries to drop: the rest written afresh (atomic renames)
                self._rewrite()
            else:  # the append in flight: cut the keys past the entries and the torn line, in place
                _cut(self._keys_path, n * width)
                _cut(path, ent.complete)

    @property
    def writes(self) -> bool:
        return self.folder is not None and not self.readonly

    def _append(self, keys: np.ndarray, lines: list[str]) -> None:
        if not self.writes:
            return
        from lopd import failpoints

        with _writing(self._keys_path), open(self._keys_path, "ab") as fk:
            fk.write(np.ascontiguousarray(keys, dtype=np.float32).tobytes())
            fk.flush()
            os.fsync(fk.fileno())
        failpoints.reached("bank.append")  # keys written, their entries not yet
        with _writing(self._entries_path), open(self._entries_path, "a", encoding="utf-8") as fe:
            fe.write("".join(line + "\n" for line in lines))
            fe.flush()
            os.fsync(fe.fileno())

    def _rewrite(self) -> None:
        """Compact the files to exactly the in-memory state: both written to temporary files and fsynced, then
        renamed, keys first (`_finish_rewrite` completes a rewrite killed between the renames)."""
        tmp_e, tmp_k = self._entries_path.with_suffix(".tmp"), self._keys_path.with_suffix(".tmp")
        with _writing(self.folder):
            with open(tmp_k, "wb") as f:
                f.write(self.keys.astype(np.float32).tobytes())
                os.fsync(f.fileno())
            with open(tmp_e, "w", encoding="utf-8") as f:
                f.writelines([json.dumps({"compacted": self.compacted}) + "\n"] if self.compacted else [])
                f.writelines(json.dumps(asdict(e)) + "\n" for e in self.entries)
                f.writelines(json.dumps({"evict": int(i)}) + "\n" for i in np.flatnonzero(~self.alive))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_k, self._keys_path)
            os.replace(tmp_e, self._entries_path)
            _fsync_dir(self.folder)

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
            self._index(e)
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
            with _writing(self._entries_path), open(self._entries_path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps({"evict": int(i)}) + "\n" for i in victims)
                f.flush()
                os.fsync(f.fileno())
        if (~self.alive).sum() > max(1000, self.capacity):  # keep the files from growing without bound
            self._compact()

    def _compact(self) -> None:
        keep = np.flatnonzero(self.alive)
        self.compacted += len(self.entries) - len(keep)
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
               min_similarity: float = -1.0, distinct: bool = False,
               only: Sequence[Sequence[int] | None] | None = None) -> Retrieved:
        """Top-k entries by cosine similarity for each query key [Q, dim]. `distinct`: never two entries with
        the same (task text, trajectory): a group's identical successes share their task's key, and would
        otherwise fill the k places with one experience. `only[q]`: the entry ids query q may retrieve (None:
        any), e.g. the entries that called one of the task's tools (`calling`)."""
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
        for q, ids in enumerate(only or []):
            if ids is not None:
                allowed = torch.zeros(sims.shape[1], dtype=torch.bool)
                allowed[list(ids)] = True
                sims[q, ~allowed] = -torch.inf
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

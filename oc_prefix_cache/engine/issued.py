"""What each prepare did, kept until the real request's report says whether it served.

Why a record per prepare, with an id the front door sends back: the report must bind the slot's
new contents to the conversation that prepare was for, and nothing else. Before ids, a report
was matched to the latest prepare of the same head, another conversation's when several ran at
once; a skipped or failed prepare gets an id of no record, so its report binds nothing.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import xxhash

MAX_RECORDS = 256  # prepares remembered for their reports


@dataclass(frozen=True)
class Record:
    """What a prepare did, kept until its report arrives."""

    slot: int
    epoch: int
    action: str  # the prepare's action; "side" (a title's), "skipped" only where its report may adopt the slot
    fingerprint: str
    expected: int  # tokens the real request should reuse
    conversation: str
    file: str  # the file restored or saved ("" for hits)
    planned_split: bool
    stored: int  # tokens of the longest prefix of the slot's contents already in a file
    source: str = ""  # what the request reuses (PrepareResult.source)
    harness: str = ""  # the request's User-Agent product, for the event log


class Records:
    """The newest ``MAX_RECORDS`` prepares by id. Thread-safe."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._records: OrderedDict[str, Record] = OrderedDict()
        self._seq = 0

    def keep(self, record: Record) -> str:
        """Keep what a prepare did until its report; its id."""
        with self._guard:
            self._seq += 1
            prepare_id = f"{self._seq:x}-{xxhash.xxh32_hexdigest(f'{time.time_ns()}{record.slot}'.encode())}"
            self._records[prepare_id] = record
            while len(self._records) > MAX_RECORDS:
                self._records.popitem(last=False)
        return prepare_id

    def label(self, prepare_id: str, harness: str) -> None:
        """The front door's name for the agent, once it is known."""
        with self._guard:
            record = self._records.get(prepare_id)
            if record is not None:
                self._records[prepare_id] = replace(record, harness=harness)

    def unrecorded_id(self) -> str:
        """The id of a prepare that recorded nothing (skipped, failed). Why: the plugin reports
        every answer that has a fingerprint; without an id, its report was matched to the
        latest prepare of that head, another conversation's, and bound the slot to it."""
        with self._guard:
            self._seq += 1
            return f"{self._seq:x}-none"

    def find(self, prepare_id: str, fingerprint: str) -> Record | None:
        """By id (this plugin; an id of no record finds none), else the latest prepare of that
        fingerprint (plugins older than the id, which send none)."""
        with self._guard:
            if prepare_id:
                return self._records.get(prepare_id)
            for record in reversed(self._records.values()):
                if record.fingerprint == fingerprint:
                    return record
            return None

"""The data-parallel balancer as a pure class: least load (reported plus sent since), prefix
affinity within the slack, turns among equals; and the prefix table it reads, private or
shared through a file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.frontend.dp_balancer import DataParallelBalancer, affinity_slack
from actors.frontend.prefix_affinity import (
    MAX_AFFINITY_TOKENS,
    PrefixAffinity,
    prefix_hashes,
)
from actors.protocol.messages import CoreLoad

BLOCK = 16
SYSTEM = list(range(1000, 1040))  # 40 tokens: two full blocks every chat shares
ROOT = Path(__file__).resolve().parents[2]


def chat(user: int, length: int = 24) -> list[int]:
    return SYSTEM + [user] * length


def test_prefix_hashes_name_full_blocks_and_their_whole_prefix() -> None:
    a = prefix_hashes(list(range(50)), BLOCK)
    b = prefix_hashes([*range(40), 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], BLOCK)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # the 2 leftover tokens count not
    assert prefix_hashes([9, *range(1, 50)], BLOCK)[1] != a[1]  # block 1 covers block 0 too
    assert prefix_hashes(list(range(50)), BLOCK, "salt")[0] != a[0]
    assert prefix_hashes(list(range(15)), BLOCK) == []
    assert len(prefix_hashes([1] * (2 * MAX_AFFINITY_TOKENS), BLOCK)) == MAX_AFFINITY_TOKENS // 16
    assert all(0 < h < 2**64 for h in a)


def test_prefix_hashes_are_the_same_in_every_process() -> None:
    """API servers share the table, so a prefix must hash alike whatever PYTHONHASHSEED
    each process got."""
    code = (
        "from actors.frontend.prefix_affinity import prefix_hashes;"
        "print(prefix_hashes(list(range(40)), 16, 'salt'))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert outputs == {f"{prefix_hashes(list(range(40)), 16, 'salt')}\n"}


def test_the_table_counts_the_leading_blocks_each_core_was_sent() -> None:
    table = PrefixAffinity()
    hashes = prefix_hashes(chat(1), BLOCK)
    assert table.matched_blocks(hashes, 3) == [0, 0, 0]
    table.record(hashes[:2], 2)
    table.record(hashes, 0)
    assert table.matched_blocks(hashes, 3) == [4, 0, 2]  # 64 tokens: 4 blocks
    other = prefix_hashes(chat(2), BLOCK)  # the same system blocks, another user turn
    assert table.matched_blocks(other, 3) == [2, 0, 2]


def test_the_table_file_is_shared_between_processes_that_map_it(tmp_path: Path) -> None:
    path = str(tmp_path / "affinity")
    PrefixAffinity.create(path)
    writer, reader = PrefixAffinity.open(path), PrefixAffinity.open(path)
    try:
        hashes = prefix_hashes(chat(3), BLOCK)
        writer.record(hashes, 5)
        assert reader.matched_blocks(hashes, 8) == [0, 0, 0, 0, 0, 4, 0, 0]
    finally:
        writer.close()
        reader.close()
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_burst_of_distinct_prompts_alternates_between_cores() -> None:
    balancer = DataParallelBalancer(2, BLOCK)
    chosen = [balancer.choose([i] * 40) for i in range(40)]
    assert chosen.count(0) == chosen.count(1) == 20
    assert balancer.loads() == [20, 20]


def test_a_burst_sharing_a_system_prompt_spreads_at_once() -> None:
    """The shared 32 tokens are worth half a request: the second request already goes to
    the idle core, and from then on both hold them."""
    balancer = DataParallelBalancer(2, BLOCK)
    chosen = [balancer.choose(chat(i)) for i in range(40)]
    assert chosen[:4] == [0, 1, 0, 1]
    assert chosen.count(0) == chosen.count(1) == 20


def test_reports_count_what_the_core_took_in_and_the_rest_is_on_its_way() -> None:
    balancer = DataParallelBalancer(3, BLOCK)
    for i in range(3):
        balancer.choose([i] * 32)
    assert balancer.loads() == [1, 1, 1]
    balancer.report(0, CoreLoad(num_running=4, num_waiting=2, num_received=1))
    balancer.report(1, CoreLoad(num_running=0, num_waiting=0, num_received=0))  # in flight
    balancer.report(2, CoreLoad(num_running=0, num_waiting=0, num_received=1))  # done
    assert balancer.loads() == [6, 1, 0]
    assert balancer.choose([9] * 32) == 2
    balancer.report(2, CoreLoad(0, 0, num_received=5))  # a predecessor's count: none on its way
    assert balancer.loads() == [6, 1, 0]


class _Cores:
    """A balancer and what its cores took in, for reports of a chosen load."""

    def __init__(self, num_cores: int) -> None:
        self.balancer = DataParallelBalancer(num_cores, BLOCK)
        self.taken = [0] * num_cores

    def choose(self, prompt: list[int]) -> int:
        core = self.balancer.choose(prompt)
        self.taken[core] += 1
        return core

    def report(self, core: int, num_running: int) -> None:
        self.balancer.report(core, CoreLoad(num_running, 0, self.taken[core]))


def test_a_conversation_stays_on_its_core_while_its_prefix_is_worth_more_than_the_load() -> None:
    """A 300-token history is worth the cap (2 requests at an idle server): the next turn
    stays while its core has at most 2 requests more; a 48-token one is worth 3/4 of a
    request, so one more request there already sends the turn elsewhere."""
    for history, busiest_kept in ((300, affinity_slack(0)), (48, 0)):
        cores = _Cores(2)
        turn1 = [history] * history
        core = cores.choose(turn1)
        for load in range(busiest_kept + 2):
            cores.report(core, load)
            cores.report(1 - core, 0)
            turn2 = turn1 + [-load] * 50  # an answer and a next question, new each time
            assert cores.choose(turn2) == (core if load <= busiest_kept else 1 - core)


def test_the_cap_grows_with_the_least_load() -> None:
    assert affinity_slack(20) == 2 + 5
    cores = _Cores(2)
    turn1 = chat(2, 600)
    core = cores.choose(turn1)
    for load, chosen in ((27, core), (28, 1 - core)):
        cores.report(core, load)
        cores.report(1 - core, 20)
        assert cores.choose(turn1 + [7] * 16) == chosen


def test_the_longest_prefix_wins_among_equally_loaded_cores() -> None:
    balancer = DataParallelBalancer(3, BLOCK)
    long_prefix = list(range(64))
    balancer.affinity.record(prefix_hashes(long_prefix[:32], BLOCK), 0)
    balancer.affinity.record(prefix_hashes(long_prefix, BLOCK), 2)
    assert balancer.choose(long_prefix + [1] * 16) == 2


def test_each_api_server_starts_its_turns_at_its_own_index() -> None:
    firsts = [DataParallelBalancer(4, BLOCK, first_turn=i).choose([1] * 16) for i in range(6)]
    assert firsts == [0, 1, 2, 3, 0, 1]
    assert DataParallelBalancer(1, BLOCK).choose([1] * 64) == 0


def test_core_counts_beyond_a_bitmask_word_are_refused() -> None:
    with pytest.raises(ValueError, match="num_cores"):
        DataParallelBalancer(65, BLOCK)

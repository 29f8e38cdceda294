#!/usr/bin/env python3
"""Real-BlueZ scenario 2 in ONE boot: faults, each ending with the right store content and GAP/REGRESSION
records, 0 peripheral violations throughout. The peripheral corrupts (2 % of frames) and drops (8 % of notifications)
DATA for the whole run, and drops the link once after 150 frames.

 a. disconnect mid-burst: the first sync ends early (exit 1, clear error), committed <= acknowledged is kept;
 b. a second sync completes: all 600 events stored exactly once, NO GAP although frames were corrupted and
    notifications dropped (the peripheral still had every event: re-request, not a GAP);
 c. epoch reset (control `wipe`, then 100 new events): a new stream with all its events; the old stream's
    rows kept;
 d. counter regression (control `regress 40` + 30 new events, same epoch): a REGRESSION outbox event
    (cursor = the old head, head 70), a rebased stream with the new events 41..70, the unrecoverable 1..40
    as ONE GAP.

Host: python3 Tests/testbed/sync_faults.py [--results DIR]      (build ferry first: swift build)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bedlib as b  # noqa: E402

SCENARIO = "sync_faults"
EVENTS = 600
BED_ARGS = ["--peripherals", "1", "--events", str(EVENTS), "--fault", "corrupt=0.02", "--fault", "drop=0.08",
            "--fault", "disconnect=150"]


def violations_zero(c: b.Checks, label: str, addr: str) -> dict:
    s = b.stats(addr)
    c.check(f"{label} peripheral: 0 violations", s["violations"] == 0, f"{s['violations']} {s['violation_list'][:3]}")
    return s


def guest() -> int:
    c = b.Checks(SCENARIO)
    addr = b.peripherals()[0]
    db = os.path.join(b.scratch(), "ferry.sqlite")
    try:
        # a. disconnect mid-burst
        r = b.ferry(b.sync_args(addr, db, timeout=90), limit=120)
        s = b.stats_when(addr, lambda st: st["faults_injected"].get("disconnect") == 1)
        store = b.Store(db)
        streams = store.streams(addr)
        cursor = streams[0]["cursor"] if streams else -1
        c.note(f"a: {r.brief()}")
        c.check("a peripheral dropped the link mid-burst (disconnect fault fired once)",
                s["faults_injected"].get("disconnect") == 1, str(s["faults_injected"]))
        c.check("a first sync: exit 1 with one 'ferry: ...' line, stopped short of the head",
                r.rc == 1 and len([l for l in r.error_lines if l.startswith("ferry: ")]) == 1 and 0 < cursor < EVENTS,
                f"rc {r.rc}, cursor {cursor}, stderr {r.error_lines[-2:]}")
        c.check("a store cursor >= peripheral highest_ack (nothing acknowledged uncommitted)",
                cursor >= s["highest_ack"], f"cursor {cursor}, highest_ack {s['highest_ack']}")
        store.close()
        violations_zero(c, "a", addr)

        # b. the next sync completes despite corrupt frames and dropped notifications
        r = b.ferry(b.sync_args(addr, db, timeout=120), limit=150)
        j = r.json or {}
        c.note(f"b: {r.brief()}")
        c.check("b second sync: exit 0, caught up at 600", r.rc == 0 and j.get("cursor") == str(EVENTS), r.brief())
        s = violations_zero(c, "b", addr)
        fi = s["faults_injected"]
        c.check("b corrupt and drop faults actually fired", fi.get("corrupt", 0) > 0 and fi.get("drop", 0) > 0, str(fi))
        epoch1 = int(s["epoch"])
        store = b.Store(db)
        b.check_stream_content(c, "b", store, addr, str(epoch1), epoch1, s["generation"], range(1, EVENTS + 1))
        c.check("b no GAP recorded (the peripheral still had every event)", not store.events(addr, "GAP"),
                str(store.events(addr, "GAP")))
        store.close()

        # c. epoch reset. The bed's `wipe` gives a new epoch and restarts seq at 1 with its --events K events
        # (TESTBED.md says "no events"; read the head instead of assuming either), then 100 more are added.
        old_rows = len(b.Store(db).frames(addr, str(epoch1)))
        b.control(f"wipe {addr}")
        s = b.wait_stats(addr, lambda s: int(s["epoch"]) != epoch1, 15)
        c.check("c peripheral wiped: new epoch", s is not None)
        base = s["head"] if s else 0
        b.control(f"add {addr} 100")
        s = b.wait_stats(addr, lambda s: int(s["epoch"]) != epoch1 and s["head"] == base + 100, 15)
        head2 = base + 100
        c.check(f"c peripheral holds {head2} events (seq 1..{head2}) in the new epoch", s is not None)
        epoch2 = int(b.stats(addr)["epoch"])
        r = b.ferry(b.sync_args(addr, db, timeout=120), limit=150)
        j = r.json or {}
        c.note(f"c: {r.brief()}")
        c.check(f"c sync after the epoch reset: exit 0, new epoch, cursor {head2}",
                r.rc == 0 and j.get("epoch") == str(epoch2) and j.get("cursor") == str(head2), r.brief())
        s = violations_zero(c, "c", addr)
        store = b.Store(db)
        streams = {st["epoch"]: st for st in store.streams(addr)}
        c.check(f"c two streams: old (cursor {EVENTS}) kept, new (cursor {head2})",
                streams.get(str(epoch1), {}).get("cursor") == EVENTS
                and streams.get(str(epoch2), {}).get("cursor") == head2, str(streams))
        b.check_stream_content(c, "c new epoch", store, addr, str(epoch2), epoch2, s["generation"],
                               range(1, head2 + 1))
        c.check("c old epoch's rows kept", len(store.frames(addr, str(epoch1))) == old_rows,
                f"{len(store.frames(addr, str(epoch1)))} rows, {old_rows} before")
        gaps2 = [g for g in store.events(addr, "GAP") if g["epoch"] == str(epoch2)]
        c.check("c no GAP recorded on the new stream", not gaps2, str(gaps2))
        store.close()

        # d. counter regression: same epoch, head back to 40, then 30 new events (41..70, new bytes)
        epoch2_rows = len(b.Store(db).frames(addr, str(epoch2)))
        b.control(f"regress {addr} 40")
        s = b.wait_stats(addr, lambda s: s["head"] == 40 and s["generation"] == 1, 15)
        b.control(f"add {addr} 30")
        s = b.wait_stats(addr, lambda s: s["head"] == 70 and s["generation"] == 1, 15)
        c.check(f"d peripheral regressed: same epoch, head 70 < gateway cursor {head2}",
                s is not None and int(s["epoch"]) == epoch2, str(s and {k: s[k] for k in ('epoch', 'head', 'oldest')}))
        r = b.ferry(b.sync_args(addr, db, timeout=90), limit=120)
        j = r.json or {}
        c.note(f"d: {r.brief()}")
        c.check("d sync after the regression: exit 0, caught up, 1 regression reported",
                r.rc == 0 and j.get("regressions") == 1 and j.get("cursor") == "70", r.brief())
        s = violations_zero(c, "d", addr)
        store = b.Store(db)
        regs = store.events(addr, "REGRESSION")
        c.check(f"d one REGRESSION outbox event (epoch, cursor {head2}, head 70)",
                len(regs) == 1 and regs[0]["epoch"] == str(epoch2) and regs[0]["payload"].get("cursor") == str(head2)
                and regs[0]["payload"].get("head") == "70", str(regs))
        all_streams = store.streams(addr)
        rebased = [st for st in all_streams if st["device_epoch"] == str(epoch2) and st["epoch"] != str(epoch2)]
        old = [st for st in all_streams if st["epoch"] == str(epoch2)]
        c.check(f"d stream rebased: old one inactive at cursor {head2}, new active one at cursor 70 (same device epoch)",
                len(rebased) == 1 and rebased[0]["active"] and rebased[0]["cursor"] == 70
                and len(old) == 1 and not old[0]["active"] and old[0]["cursor"] == head2, str(all_streams))
        if rebased:
            key = rebased[0]["epoch"]
            frames = store.frames(addr, key)
            c.check("d rebased stream holds the new events 41..70 exactly, with the new (generation 1) bytes",
                    sorted(frames) == list(range(41, 71))
                    and all(frames[q] == b.expected_payload(epoch2, 1, q) for q in range(41, 71)),
                    f"seqs {sorted(frames)[:5]}..{sorted(frames)[-3:]} ({len(frames)})")
            gaps = [g for g in store.events(addr, "GAP") if g["epoch"] == key]
            c.check("d exactly one GAP on the rebased stream, 1..40 (the peripheral no longer has them)",
                    len(gaps) == 1 and (gaps[0]["first_seq"], gaps[0]["last_seq"]) == (1, 40), str(gaps))
        c.check("d earlier rows kept",
                len(store.frames(addr, str(epoch1))) == old_rows and len(store.frames(addr, str(epoch2))) == epoch2_rows)
        store.close()
    except Exception as e:  # a crash in the scenario is a failure, with its reason in checks.json
        c.crashed(e)
    return c.finish()


if __name__ == "__main__":
    if "--guest" in sys.argv:
        sys.exit(guest())
    sys.exit(b.host_main(__file__, SCENARIO, BED_ARGS, bed_timeout=900))

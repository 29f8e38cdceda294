#!/usr/bin/env python3
"""Real-BlueZ scenario 2 in ONE boot: faults, each ending with the right store content and GAP/REGRESSION
records, 0 peripheral violations throughout. The peripheral corrupts (2 %) and drops (2 % of notifications)
DATA for the whole run, and drops the link once after 150 frames.

 a. disconnect mid-burst: the first sync ends early (exit 1, clear error), committed <= acknowledged is kept;
 b. a second sync completes: all 600 events stored exactly once, NO GAP although frames were corrupted and
    notifications dropped (the peripheral still had every event: re-request, not a GAP);
 c. epoch reset (control `wipe` + 100 new events): a new stream, 100 events; the old stream's rows kept;
 d. counter regression (control `regress 40` + 30 new events, same epoch): a REGRESSION outbox event
    (cursor 100, head 70), a rebased stream with the new events 41..70, the unrecoverable 1..40 as ONE GAP.

Host: python3 Tests/testbed/sync_faults.py [--results DIR]      (build ferry first: swift build)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bedlib as b  # noqa: E402

SCENARIO = "sync_faults"
EVENTS = 600
BED_ARGS = ["--peripherals", "1", "--events", str(EVENTS), "--fault", "corrupt=0.02", "--fault", "drop=0.02",
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
        s = b.stats(addr)
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

        # c. epoch reset: storage wiped, 100 new events under a new epoch
        b.control(f"wipe {addr}")
        s = b.wait_stats(addr, lambda s: int(s["epoch"]) != epoch1 and s["head"] == 0, 15)
        b.control(f"add {addr} 100")
        s = b.wait_stats(addr, lambda s: int(s["epoch"]) != epoch1 and s["head"] == 100, 15)
        c.check("c peripheral wiped: new epoch, 100 events", s is not None)
        epoch2 = int(b.stats(addr)["epoch"])
        r = b.ferry(b.sync_args(addr, db, timeout=90), limit=120)
        j = r.json or {}
        c.check("c sync after the epoch reset: exit 0, new epoch, cursor 100",
                r.rc == 0 and j.get("epoch") == str(epoch2) and j.get("cursor") == "100", r.brief())
        s = violations_zero(c, "c", addr)
        store = b.Store(db)
        streams = {st["epoch"]: st for st in store.streams(addr)}
        c.check("c two streams: old (cursor 600) kept, new (cursor 100)",
                streams.get(str(epoch1), {}).get("cursor") == EVENTS and streams.get(str(epoch2), {}).get("cursor") == 100,
                str(streams))
        b.check_stream_content(c, "c new epoch", store, addr, str(epoch2), epoch2, s["generation"], range(1, 101))
        c.check("c old epoch's 600 rows kept", len(store.frames(addr, str(epoch1))) == EVENTS)
        c.check("c no GAP recorded", not store.events(addr, "GAP"), str(store.events(addr, "GAP")))
        store.close()

        # d. counter regression: same epoch, head back to 40, then 30 new events (41..70, new bytes)
        b.control(f"regress {addr} 40")
        s = b.wait_stats(addr, lambda s: s["head"] == 40 and s["generation"] == 1, 15)
        b.control(f"add {addr} 30")
        s = b.wait_stats(addr, lambda s: s["head"] == 70 and s["generation"] == 1, 15)
        c.check("d peripheral regressed: same epoch, head 70 < gateway cursor 100",
                s is not None and int(s["epoch"]) == epoch2, str(s and {k: s[k] for k in ('epoch', 'head', 'oldest')}))
        r = b.ferry(b.sync_args(addr, db, timeout=90), limit=120)
        j = r.json or {}
        c.note(f"d: {r.brief()}")
        c.check("d sync after the regression: exit 0, caught up, 1 regression reported",
                r.rc == 0 and j.get("regressions") == 1 and j.get("cursor") == "70", r.brief())
        s = violations_zero(c, "d", addr)
        store = b.Store(db)
        regs = store.events(addr, "REGRESSION")
        c.check("d one REGRESSION outbox event (epoch, cursor 100, head 70)",
                len(regs) == 1 and regs[0]["epoch"] == str(epoch2) and regs[0]["payload"].get("cursor") == "100"
                and regs[0]["payload"].get("head") == "70", str(regs))
        all_streams = store.streams(addr)
        rebased = [st for st in all_streams if st["device_epoch"] == str(epoch2) and st["epoch"] != str(epoch2)]
        old = [st for st in all_streams if st["epoch"] == str(epoch2)]
        c.check("d stream rebased: old one inactive at cursor 100, new active one at cursor 70 (same device epoch)",
                len(rebased) == 1 and rebased[0]["active"] and rebased[0]["cursor"] == 70
                and len(old) == 1 and not old[0]["active"] and old[0]["cursor"] == 100, str(all_streams))
        if rebased:
            key = rebased[0]["epoch"]
            frames = store.frames(addr, key)
            c.check("d rebased stream holds the new events 41..70 exactly, with the new (generation 1) bytes",
                    sorted(frames) == list(range(41, 71))
                    and all(frames[q] == b.expected_payload(epoch2, 1, q) for q in range(41, 71)),
                    f"seqs {sorted(frames)[:5]}..{sorted(frames)[-3:]} ({len(frames)})")
            gaps = store.events(addr, "GAP")
            c.check("d exactly one GAP, 1..40 on the rebased stream (the peripheral no longer has them)",
                    len(gaps) == 1 and gaps[0]["epoch"] == key and (gaps[0]["first_seq"], gaps[0]["last_seq"]) == (1, 40),
                    str(gaps))
        c.check("d earlier rows kept (600 + 100 old-epoch rows)",
                len(store.frames(addr, str(epoch1))) == EVENTS and len(store.frames(addr, str(epoch2))) == 100)
        store.close()
    except Exception as e:
        import traceback
        traceback.print_exc()
        c.check("scenario ran to the end", False, f"{type(e).__name__}: {e}")
    c.write()
    return 1 if c.failed else 0


if __name__ == "__main__":
    if "--guest" in sys.argv:
        sys.exit(guest())
    sys.exit(b.host_main(__file__, SCENARIO, BED_ARGS, bed_timeout=900))

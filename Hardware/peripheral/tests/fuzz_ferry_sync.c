/* libFuzzer target: the CONTROL parser and the peripheral state machine driven by arbitrary bytes.
 *
 * The input is a program: each op byte picks an event (CONTROL write of raw bytes or of a well-formed
 * SYNC_REQ/SYNC_ACK with fuzzed fields, append, pump with a fuzzed MTU/budget, subscribe toggle, BUSY
 * toggle, disconnect, restart from persisted meta, wipe, discard). After every step the invariants of
 * docs/PROTOCOL.md's peripheral side are checked; a violation aborts (a crash for libFuzzer):
 *  - the DATA stream of a connection decodes to whole DATA frames with the right bytes, no noise, except a
 *    frame cut by a disconnect; seqs strictly above the request's base, never more than `window` beyond
 *    the last ACK; - head never decreases within an epoch; epoch never 0; deleted_through <= head;
 *  - an ACK never deletes past what was delivered to (or claimed by) that gateway.
 * Build: clang -fsanitize=fuzzer,address,undefined (Hardware/peripheral/run-tests does it). */
#include <stdio.h>
#include <stdlib.h>

#include "testkit.h"

#define REQUIRE(c)                                                              \
    do {                                                                        \
        if (!(c)) { fprintf(stderr, "invariant failed: %s (line %d)\n", #c, __LINE__); abort(); } \
    } while (0)

static uint8_t ram[16 * 66];
static kit_link link_;

/* The model of one connection, as a gateway would see it. */
typedef struct {
    int requested;
    uint16_t window;
    uint64_t base;       /* max(SYNC_REQ seq, deleted_through then), raised by believable ACKs */
    uint64_t delivered;  /* highest seq claimed by this link's SYNC_REQ (capped at head) or received whole */
    size_t req_off;      /* stream offset of the latest SYNC_REQ */
    unsigned carry;      /* at most this many leading frames were already under way at that SYNC_REQ */
    uint64_t carry_limit, carry_below; /* ... within the old window, below the old replay's next seq */
    unsigned checked;    /* frames after req_off already checked */
    uint64_t deferred;   /* an ACK before the link's first SYNC_REQ, beyond what left: applied at the request */
} model;

static void on_ack(model *m, uint64_t ack);

static void on_req(model *m, const ferry_peripheral *p, const ferry_conn *c, uint64_t last, uint16_t w) {
    uint64_t hi = c->pend_frames ? c->pend_max : 0;
    if (c->frame_off < c->frame_len && c->cur_seq > hi) hi = c->cur_seq;
    m->carry = c->pend_frames + (c->frame_off < c->frame_len ? 1u : 0u);
    /* frames under way may come from an earlier request than the last one: the loosest old window */
    if (m->requested && m->base + m->window > m->carry_limit) m->carry_limit = m->base + m->window;
    m->carry_below = hi + 1;
    m->requested = 1;
    m->window = w;
    m->base = last > p->meta.deleted_through ? last : p->meta.deleted_through;
    if ((last < p->meta.head ? last : p->meta.head) > m->delivered) m->delivered = last < p->meta.head ? last : p->meta.head;
    m->req_off = link_.len;
    m->checked = 0;
}

static void after_req(model *m) {
    if (m->deferred) {
        uint64_t d = m->deferred;
        m->deferred = 0;
        on_ack(m, d);
    }
}

static uint64_t sent_ever; /* highest seq received whole on any link since the last restart/wipe */

static void on_ack(model *m, uint64_t ack) {
    uint64_t bound = m->delivered > sent_ever ? m->delivered : sent_ever;
    uint64_t eff = ack > bound ? bound : ack;
    if (ack > bound && !m->requested && ack > m->deferred) m->deferred = ack;
    if (eff > m->base) m->base = eff;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static ferry_ram_store rs;
    static ferry_peripheral per;
    static ferry_conn conn;
    ferry_storage st;
    ferry_transport t;
    size_t i = 0;
    uint64_t head_seen, epoch_seen;
    int subscribed = 0;
    model m;
    kit_decoded *d = (kit_decoded *)malloc(sizeof *d);

    REQUIRE(d != NULL);
    memset(&m, 0, sizeof m);
    sent_ever = 0;
    ferry_ram_store_init(&rs, ram, sizeof ram, 64);
    st = ferry_ram_store_callbacks(&rs);
    REQUIRE(ferry_init(&per, &st, kit_random, NULL, NULL) == FERRY_OK);
    kit_link_reset(&link_, 23);
    t = kit_transport(&link_);
    ferry_conn_open(&conn, &per, &t);
    head_seen = per.meta.head;
    epoch_seen = per.meta.epoch;

    while (i < size) {
        uint8_t op = data[i++];
        uint8_t arg = i < size ? data[i] : 0;
        switch (op % 11) {
        case 0: { /* raw CONTROL write: the parser sees arbitrary bytes */
            size_t n = arg % 40, at;
            ferry_control c;
            ferry_control_kind k;
            i++;
            at = i < size ? i : size;
            if (n > size - at) n = size - at;
            c = ferry_parse_control(data + at, n);
            if (c.kind == FERRY_CTL_SYNC_REQ) on_req(&m, &per, &conn, c.seq, c.window);
            k = ferry_on_control(&conn, data + at, n);
            if (k == FERRY_CTL_SYNC_REQ) after_req(&m);
            REQUIRE(k == c.kind && (unsigned)k < FERRY_CTL_KINDS);
            if (k == FERRY_CTL_SYNC_ACK) on_ack(&m, c.seq);
            i = at + n;
            break;
        }
        case 1: case 2: { /* well-formed SYNC_REQ around the interesting values */
            uint8_t b[32];
            uint64_t last = arg < 128 ? (uint64_t)(arg % 24) : per.meta.head - (arg % 3) + 1;
            uint16_t w = (uint16_t)(i + 1 < size ? data[i + 1] % 9 : 1);
            size_t n = kit_req(b, last, w);
            i += 2;
            if (w != 0) on_req(&m, &per, &conn, last, w);
            ferry_on_control(&conn, b, n);
            if (w != 0) after_req(&m);
            break;
        }
        case 3: { /* SYNC_ACK */
            uint8_t b[32];
            uint64_t before = per.meta.deleted_through, ack = (uint64_t)(arg % 40);
            i++;
            ferry_on_control(&conn, b, kit_ack(b, ack));
            /* an ACK never deletes what the gateway did not have */
            REQUIRE(per.meta.deleted_through <= (m.delivered > before ? m.delivered : before) ||
                    per.meta.deleted_through <= sent_ever);
            on_ack(&m, ack);
            break;
        }
        case 4: { /* append */
            uint8_t b[64];
            uint16_t n = kit_payload(per.meta.head + 1, b);
            if (ferry_append(&per, b, n, NULL) == FERRY_ERR_FULL) ferry_discard_through(&per, ferry_oldest(&per));
            i++;
            break;
        }
        case 5: case 6: /* pump with a fuzzed MTU and budget */
            link_.mtu = (uint16_t)(23 + (arg % 4) * 37);
            i++;
            REQUIRE(ferry_pump(&conn, arg % 3) >= 0);
            break;
        case 7:
            subscribed = !subscribed;
            ferry_conn_subscribe(&conn, subscribed);
            break;
        case 8:
            link_.busy_every = arg % 3;
            i++;
            break;
        case 9: /* disconnect (maybe mid-frame), maybe a restart from persisted state */
            ferry_conn_close(&conn);
            if (arg & 1) {
                REQUIRE(ferry_init(&per, &st, kit_random, NULL, ferry_ram_store_meta(&rs)) == FERRY_OK);
                sent_ever = 0;
            }
            i++;
            kit_link_reset(&link_, 23);
            ferry_conn_open(&conn, &per, &t);
            memset(&m, 0, sizeof m);
            subscribed = 0;
            break;
        default: /* store wiped */
            if (arg % 8 == 0) {
                ferry_conn_close(&conn);
                ferry_ram_store_erase(&rs);
                REQUIRE(ferry_wipe(&per) == FERRY_OK);
                kit_link_reset(&link_, 23);
                ferry_conn_open(&conn, &per, &t);
                memset(&m, 0, sizeof m);
                subscribed = 0;
                head_seen = 0;
                sent_ever = 0;
                epoch_seen = per.meta.epoch;
            }
            i++;
            break;
        }
        /* store invariants: epoch never 0 and only changes on a wipe, head never goes back, meta persisted */
        REQUIRE(per.meta.epoch != 0 && per.meta.epoch == epoch_seen);
        REQUIRE(per.meta.head >= head_seen);
        head_seen = per.meta.head;
        REQUIRE(per.meta.deleted_through <= per.meta.head);
        REQUIRE(rs.meta.head == per.meta.head && rs.meta.deleted_through == per.meta.deleted_through &&
                rs.meta.epoch == per.meta.epoch);
        /* stream invariants: whole, correct DATA frames; the replay in order from base+1 within the window */
        kit_decode(link_.stream, link_.len, d);
        REQUIRE(d->type_ok && d->payload_ok && d->bad == 0);
        {
            unsigned k;
            for (k = 0; k < d->frames && k < 8192; k++) {
                if (d->seq[k] > m.delivered) m.delivered = d->seq[k];
                if (d->seq[k] > sent_ever) sent_ever = d->seq[k];
            }
        }
        {
            unsigned k, before = 0;
            kit_decoded *dd = d;
            if (m.requested) {
                kit_decode(link_.stream + m.req_off, link_.len - m.req_off, dd);
                /* bytes of a frame cut at req_off are noise here; skip to the first whole frame */
                for (k = 0; k < dd->frames; k++) {
                    if (dd->seq[k] > m.delivered) m.delivered = dd->seq[k];
                    if (k < m.checked) continue;
                    if (k < m.carry) {
                        /* a frame under way finishes first (its start may already be on the link, so the
                         * bound is loose): old-window seqs below the old replay's next seq */
                        if (dd->seq[k] <= m.carry_limit && dd->seq[k] < m.carry_below) continue;
                        m.carry = k;
                    }
                    REQUIRE(dd->seq[k] <= m.base + m.window);
                    if (k > m.carry) REQUIRE(dd->seq[k] > dd->seq[k - 1]);
                    before++;
                }
                m.checked = dd->frames;
            }
            (void)before;
        }
    }
    free(d);
    return 0;
}

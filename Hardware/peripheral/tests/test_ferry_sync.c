/* Unit tests of ferry_sync (plain C99, no framework). Prints every failure and a closing
 * "N passed, N failed" line; exits 1 if anything failed. Built and run by Hardware/peripheral/run-tests. */
#include <stdio.h>
#include <stdlib.h>

#include "testkit.h"

static unsigned passed, failed;
#define CHECK(cond)                                                                      \
    do {                                                                                 \
        if (cond) passed++;                                                              \
        else { failed++; printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); }        \
    } while (0)

static int hex_eq(const uint8_t *b, size_t n, const char *hex) {
    size_t i;
    if (strlen(hex) != 2 * n) return 0;
    for (i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1 || v != b[i]) return 0;
    }
    return 1;
}
static size_t from_hex(uint8_t *b, const char *hex) {
    size_t i, n = strlen(hex) / 2;
    for (i = 0; i < n; i++) { unsigned v; sscanf(hex + 2 * i, "%2x", &v); b[i] = (uint8_t)v; }
    return n;
}

/* ---- fixture: a peripheral on the RAM store, one connection on a recording link */
static uint8_t ram[64 * 1024];
static ferry_ram_store rs;
static ferry_peripheral per;
static ferry_conn conn;
static kit_link link_;

static void fresh(uint16_t mtu) {
    ferry_storage st;
    ferry_ram_store_init(&rs, ram, sizeof ram, 64);
    st = ferry_ram_store_callbacks(&rs);
    CHECK(ferry_init(&per, &st, kit_random, NULL, NULL) == FERRY_OK);
    kit_link_reset(&link_, mtu);
    {
        ferry_transport t = kit_transport(&link_);
        ferry_conn_open(&conn, &per, &t);
    }
}
static void add(unsigned n) {
    while (n--) {
        uint8_t b[64];
        uint64_t seq = 0;
        uint16_t len = kit_payload(per.meta.head + 1, b);
        CHECK(ferry_append(&per, b, len, &seq) == FERRY_OK);
    }
}
static ferry_control_kind ctl_req(uint64_t last, uint16_t window) {
    uint8_t b[32];
    return ferry_on_control(&conn, b, kit_req(b, last, window));
}
static ferry_control_kind ctl_ack(uint64_t seq) {
    uint8_t b[32];
    return ferry_on_control(&conn, b, kit_ack(b, seq));
}
static int seqs_are(const kit_decoded *d, uint64_t first, uint64_t last) {
    uint64_t i;
    if (d->frames != last - first + 1) return 0;
    for (i = 0; i < d->frames; i++) if (d->seq[i] != first + i) return 0;
    return d->bad == 0 && d->tail == 0 && d->payload_ok && d->type_ok;
}

static void test_codec(void) {
    uint8_t b[64], si[FERRY_STREAM_INFO_LEN];
    CHECK(ferry_crc16(0xFFFF, (const uint8_t *)"123456789", 9) == 0x29B1);
    /* The vectors of docs/PROTOCOL.md. */
    CHECK(hex_eq(b, kit_req(b, 0, 20), "a5010000000000000000000200149ca9"));
    CHECK(hex_eq(b, kit_req(b, 41, 20), "a5010000000000000029000200143c61"));
    CHECK(hex_eq(b, ferry_encode_frame(b, sizeof b, FERRY_TYPE_DATA, 1, (const uint8_t *)"hello", 5),
                 "a5030000000000000001000568656c6c6f7771"));
    CHECK(hex_eq(b, ferry_encode_frame(b, sizeof b, FERRY_TYPE_DATA, 0x0102030405060708ull, NULL, 0),
                 "a50301020304050607080000e03a"));
    CHECK(hex_eq(b, kit_ack(b, 20), "a502000000000000001400007149"));
    CHECK(ferry_encode_frame(b, 13, FERRY_TYPE_SYNC_ACK, 1, NULL, 0) == 0); /* no room */
    ferry_encode_stream_info(si, 0x1122334455667788ull, 5, 9);
    CHECK(hex_eq(si, sizeof si, "01001122334455667788000000000000000500000000000000" "09"));
}

static void test_control_parser(void) {
    uint8_t b[64];
    size_t n;
    ferry_control c;
    n = from_hex(b, "a5010000000000000029000200143c61");
    c = ferry_parse_control(b, n);
    CHECK(c.kind == FERRY_CTL_SYNC_REQ && c.seq == 41 && c.window == 20);
    n = from_hex(b, "a502000000000000001400007149");
    c = ferry_parse_control(b, n);
    CHECK(c.kind == FERRY_CTL_SYNC_ACK && c.seq == 20);
    CHECK(ferry_parse_control(NULL, 0).kind == FERRY_CTL_SHORT);
    CHECK(ferry_parse_control(b, 13).kind == FERRY_CTL_SHORT);
    b[0] = 0xA4;
    CHECK(ferry_parse_control(b, n).kind == FERRY_CTL_BAD_MAGIC);
    b[0] = 0xA5;
    b[n - 1] ^= 1;
    CHECK(ferry_parse_control(b, n).kind == FERRY_CTL_BAD_CRC);
    b[n - 1] ^= 1;
    CHECK(ferry_parse_control(b, n + 1).kind == FERRY_CTL_LENGTH_MISMATCH); /* trailing byte */
    n = from_hex(b, "a5010000000000000029000200143c61");
    CHECK(ferry_parse_control(b, n - 1).kind == FERRY_CTL_LENGTH_MISMATCH);
    b[10] = 0xFF; b[11] = 0xFF; /* announces 65535 payload bytes in a 16-byte write */
    CHECK(ferry_parse_control(b, n).kind == FERRY_CTL_LENGTH_MISMATCH);
    CHECK(ferry_parse_control(b, ferry_encode_frame(b, sizeof b, FERRY_TYPE_DATA, 1, (const uint8_t *)"x", 1)).kind ==
          FERRY_CTL_UNEXPECTED_TYPE);
    CHECK(ferry_parse_control(b, ferry_encode_frame(b, sizeof b, 0x7E, 1, NULL, 0)).kind == FERRY_CTL_UNEXPECTED_TYPE);
    CHECK(ferry_parse_control(b, ferry_encode_frame(b, sizeof b, FERRY_TYPE_SYNC_REQ, 1, NULL, 0)).kind ==
          FERRY_CTL_BAD_REQ_PAYLOAD);
    CHECK(ferry_parse_control(b, ferry_encode_frame(b, sizeof b, FERRY_TYPE_SYNC_REQ, 1, (const uint8_t *)"abc", 3))
              .kind == FERRY_CTL_BAD_REQ_PAYLOAD);
    CHECK(ferry_parse_control(b, ferry_encode_frame(b, sizeof b, FERRY_TYPE_SYNC_ACK, 1, (const uint8_t *)"a", 1))
              .kind == FERRY_CTL_BAD_ACK_PAYLOAD);
    CHECK(ferry_parse_control(b, kit_req(b, 3, 0)).kind == FERRY_CTL_WINDOW_ZERO);
}

static void test_replay_packing(void) {
    kit_decoded d;
    int boundary_inside = 0;
    size_t off = 0;
    unsigned i;
    fresh(23); /* 20-byte notifications: every frame (14..73 bytes) spans several */
    add(10);
    CHECK(ferry_pump(&conn, 0) == 0); /* nothing before subscribe + SYNC_REQ */
    ferry_conn_subscribe(&conn, 1);
    CHECK(ferry_pump(&conn, 0) == 0);
    CHECK(ctl_req(0, 20) == FERRY_CTL_SYNC_REQ);
    CHECK(ferry_pump(&conn, 0) > 0);
    kit_decode(link_.stream, link_.len, &d);
    CHECK(seqs_are(&d, 1, 10));
    CHECK(link_.max_note == 20);
    CHECK(link_.len == (size_t)(link_.notes - 1) * 20 + (link_.len - (size_t)(link_.notes - 1) * 20)); /* all but last full */
    CHECK(link_.len > (size_t)(link_.notes - 1) * 20);
    /* back to back: frame boundaries fall inside notifications */
    for (i = 0; i < d.frames; i++) {
        off += FERRY_OVERHEAD + kit_payload(d.seq[i], ram /* scratch, length only */);
        if (off % 20 != 0 && off < link_.len) boundary_inside = 1;
    }
    fresh(247);
    add(10);
    ferry_conn_subscribe(&conn, 1);
    ctl_req(0, 20);
    ferry_pump(&conn, 0);
    kit_decode(link_.stream, link_.len, &d);
    CHECK(seqs_are(&d, 1, 10));
    CHECK(link_.notes == (link_.len + 243) / 244); /* several frames per notification */
    CHECK(boundary_inside);
    CHECK(per.stats.frames_sent == 10);
}

static void test_window_ack_and_below(void) {
    kit_decoded d;
    uint8_t si[FERRY_STREAM_INFO_LEN];
    fresh(100);
    add(50);
    ferry_conn_subscribe(&conn, 1);
    ctl_req(0, 20);
    ferry_pump(&conn, 0);
    kit_decode(link_.stream, link_.len, &d);
    CHECK(seqs_are(&d, 1, 20)); /* never more than window beyond the last ACK */
    CHECK(ctl_ack(20) == FERRY_CTL_SYNC_ACK);
    CHECK(per.meta.deleted_through == 20 && ferry_oldest(&per) == 21);
    ferry_stream_info(&per, si);
    CHECK(si[17] == 21 && si[25] == 50);
    link_.len = 0;
    ferry_pump(&conn, 0);
    kit_decode(link_.stream, link_.len, &d);
    CHECK(seqs_are(&d, 21, 40));
    /* SYNC_REQ below the last ACK: the replay starts at the oldest retained event. */
    ctl_ack(25);
    link_.len = 0;
    ctl_req(5, 10);
    ferry_pump(&conn, 0);
    kit_decode(link_.stream, link_.len, &d);
    CHECK(seqs_are(&d, 26, 35));
    /* window 0: refused, counted, nothing changes */
    link_.len = 0;
    CHECK(ctl_req(40, 0) == FERRY_CTL_WINDOW_ZERO);
    CHECK(per.stats.control_errors[FERRY_CTL_WINDOW_ZERO] == 1);
    CHECK(ferry_pump(&conn, 0) == 0);
    /* unknown/garbage writes change nothing */
    CHECK(ferry_on_control(&conn, (const uint8_t *)"garbage-garbage!", 16) == FERRY_CTL_BAD_MAGIC);
    CHECK(ferry_pump(&conn, 0) == 0);
}

static void test_ack_beyond_sent(void) {
    fresh(100);
    add(50);
    ferry_conn_subscribe(&conn, 1);
    ctl_req(0, 5);
    ferry_pump(&conn, 0);
    CHECK(ctl_ack(40) == FERRY_CTL_SYNC_ACK);
    CHECK(per.stats.ack_beyond_sent == 1);
    CHECK(per.meta.deleted_through == 5); /* only what was delivered */
    /* a new link: Ferry acknowledges its stored cursor BEFORE its SYNC_REQ; believable up to what left */
    ferry_conn_close(&conn);
    {
        ferry_transport t = kit_transport(&link_);
        ferry_conn_open(&conn, &per, &t);
    }
    ctl_ack(5);
    CHECK(per.stats.ack_beyond_sent == 1 && per.meta.deleted_through == 5);
    ctl_ack(6); /* beyond what left, before any SYNC_REQ: waits for the request */
    CHECK(per.stats.ack_beyond_sent == 1 && per.meta.deleted_through == 5);
    ctl_req(6, 5);
    CHECK(per.stats.ack_beyond_sent == 1 && per.meta.deleted_through == 6);
    ferry_conn_close(&conn);
    {
        ferry_transport t = kit_transport(&link_);
        ferry_conn_open(&conn, &per, &t);
    }
    ctl_ack(30); /* ...and is applied only as far as that request claims */
    ctl_req(20, 5);
    CHECK(per.stats.ack_beyond_sent == 2 && per.meta.deleted_through == 20);
    per.stats.ack_beyond_sent = 1;
    /* caught-up gateway: SYNC_REQ(cursor) then ACK(cursor) at once is legitimate */
    ferry_conn_close(&conn);
    {
        ferry_transport t = kit_transport(&link_);
        ferry_conn_open(&conn, &per, &t);
    }
    ctl_req(22, 5);
    ctl_ack(22);
    CHECK(per.meta.deleted_through == 22 && per.stats.ack_beyond_sent == 1);
    /* ACK above head after a regression-looking REQ: clamped to head */
    ctl_req(1000, 5);
    CHECK(per.stats.req_beyond_head == 1);
    ctl_ack(1000);
    CHECK(per.meta.deleted_through == 50 && ferry_oldest(&per) == 0);
}

static void test_disconnect_mid_frame_and_new_req(void) {
    kit_decoded d;
    fresh(23);
    add(5);
    ferry_conn_subscribe(&conn, 1);
    ctl_req(0, 20);
    CHECK(ferry_pump(&conn, 2) == 2); /* 40 bytes: frame 1 (14+7) + part of frame 2 */
    ferry_conn_close(&conn);
    CHECK(per.meta.deleted_through == 0 && per.meta.head == 5);
    kit_link_reset(&link_, 23);
    {
        ferry_transport t = kit_transport(&link_);
        ferry_conn_open(&conn, &per, &t);
    }
    CHECK(ferry_pump(&conn, 0) == 0);
    ferry_conn_subscribe(&conn, 1);
    ctl_req(0, 20);
    ferry_pump(&conn, 0);
    kit_decode(link_.stream, link_.len, &d);
    CHECK(seqs_are(&d, 1, 5));
    /* a new SYNC_REQ mid-frame: the started frame is finished, then the replay restarts */
    kit_link_reset(&link_, 23);
    ctl_req(0, 20);
    ferry_pump(&conn, 1);
    ctl_req(2, 20);
    ferry_pump(&conn, 0);
    kit_decode(link_.stream, link_.len, &d);
    CHECK(d.bad == 0 && d.frames == 4 && d.seq[0] == 1 && d.seq[1] == 3 && d.seq[3] == 5);
}

static void test_live_and_flow(void) {
    kit_decoded d;
    fresh(50);
    ferry_conn_subscribe(&conn, 1);
    ctl_req(0, 100);
    CHECK(ferry_pump(&conn, 0) == 0);
    add(3);
    ferry_pump(&conn, 0);
    kit_decode(link_.stream, link_.len, &d);
    CHECK(seqs_are(&d, 1, 3));
    /* flow control */
    link_.can_send = 0;
    add(2);
    CHECK(ferry_pump(&conn, 0) == 0);
    link_.can_send = 1;
    /* BUSY: the same bytes go again, nothing lost or doubled */
    link_.busy_every = 2;
    add(20);
    while (ferry_pump(&conn, 0) > 0) {}
    kit_decode(link_.stream, link_.len, &d);
    CHECK(seqs_are(&d, 1, 25));
    /* unsubscribe stops DATA; a dead link is reported */
    link_.busy_every = 0;
    ferry_conn_subscribe(&conn, 0);
    add(1);
    CHECK(ferry_pump(&conn, 0) == 0);
    ferry_conn_subscribe(&conn, 1);
    link_.fail = 1;
    CHECK(ferry_pump(&conn, 0) == FERRY_ERR_LINK);
}

/* Storage whose persist can be made to fail: the "power cut between record and counter" case. */
static int persist_fails;
static int flaky_persist(void *ctx, const ferry_meta *m) {
    if (persist_fails) return FERRY_ERR_STORAGE;
    return ferry_ram_store_callbacks((ferry_ram_store *)ctx).persist(ctx, m);
}

static void test_persistence(void) {
    ferry_storage st;
    uint64_t epoch, seq = 0;
    uint8_t b[4] = {1, 2, 3, 4};
    kit_decoded d;
    fresh(60);
    add(3);
    epoch = per.meta.epoch;
    CHECK(epoch != 0);
    /* restart: same store, new library state */
    st = ferry_ram_store_callbacks(&rs);
    st.persist = flaky_persist;
    CHECK(ferry_init(&per, &st, kit_random, NULL, ferry_ram_store_meta(&rs)) == FERRY_OK);
    CHECK(per.meta.epoch == epoch && per.meta.head == 3);
    persist_fails = 1;
    CHECK(ferry_append(&per, b, 4, &seq) == FERRY_ERR_STORAGE);
    CHECK(per.meta.head == 3 && rs.meta.head == 3); /* never visible */
    persist_fails = 0;
    /* "power cut": reload from what was persisted; seq 4 is written again with the new event */
    CHECK(ferry_init(&per, &st, kit_random, NULL, ferry_ram_store_meta(&rs)) == FERRY_OK);
    add(1);
    CHECK(per.meta.head == 4 && rs.meta.head == 4);
    {
        ferry_transport t = kit_transport(&link_);
        ferry_conn_open(&conn, &per, &t);
    }
    kit_link_reset(&link_, 60);
    ferry_conn_subscribe(&conn, 1);
    ctl_req(0, 10);
    ferry_pump(&conn, 0);
    kit_decode(link_.stream, link_.len, &d);
    CHECK(seqs_are(&d, 1, 4)); /* seq 4 carries the new event's bytes, not the failed one's */
    /* ACK: deleted_through persisted */
    ctl_ack(2);
    CHECK(rs.meta.deleted_through == 2);
    /* wipe: a new random epoch, seq restarts at 1 */
    ferry_ram_store_erase(&rs);
    CHECK(ferry_wipe(&per) == FERRY_OK);
    CHECK(per.meta.epoch != epoch && per.meta.epoch != 0 && per.meta.head == 0 && rs.meta.epoch == per.meta.epoch);
    add(1);
    CHECK(per.meta.head == 1);
    /* corrupt meta (deleted_through > head) is repaired */
    {
        ferry_meta m = {7, 3, 9};
        CHECK(ferry_init(&per, &st, kit_random, NULL, &m) == FERRY_OK && per.meta.deleted_through == 3);
    }
}

static int zero_random(void *ctx, uint8_t out[8]) {
    (void)ctx;
    memset(out, 0, 8);
    return FERRY_OK;
}
static int read_fails_at_3(void *ctx, uint64_t seq, uint8_t *buf, uint16_t cap) {
    if (seq == 3) return FERRY_ERR_STORAGE;
    return ferry_ram_store_callbacks((ferry_ram_store *)ctx).read(ctx, seq, buf, cap);
}

static void test_errors(void) {
    ferry_storage st;
    kit_decoded d;
    uint8_t big[FERRY_MAX_PAYLOAD + 1];
    ferry_ram_store_init(&rs, ram, sizeof ram, 64);
    st = ferry_ram_store_callbacks(&rs);
    CHECK(ferry_init(&per, &st, zero_random, NULL, NULL) == FERRY_ERR_RANDOM); /* epoch 0 never used */
    CHECK(ferry_init(&per, &st, NULL, NULL, NULL) == FERRY_ERR_RANDOM);
    CHECK(ferry_init(&per, NULL, kit_random, NULL, NULL) == FERRY_ERR_ARG);
    fresh(60);
    memset(big, 0, sizeof big);
    CHECK(ferry_append(&per, big, FERRY_MAX_PAYLOAD + 1, NULL) == FERRY_ERR_ARG);
    CHECK(ferry_append(&per, big, 65, NULL) == FERRY_ERR_STORAGE); /* larger than a RAM slot */
    /* store full, then room by discarding (the gateway sees oldest move: a GAP, not silence) */
    {
        static uint8_t small[10 * 8];
        ferry_ram_store_init(&rs, small, sizeof small, 8);
        st = ferry_ram_store_callbacks(&rs);
        CHECK(ferry_init(&per, &st, kit_random, NULL, NULL) == FERRY_OK);
        CHECK(rs.slots == 8);
        while (ferry_append(&per, big, 4, NULL) == FERRY_OK) {}
        CHECK(per.meta.head == 8 && ferry_append(&per, big, 4, NULL) == FERRY_ERR_FULL);
        CHECK(ferry_discard_through(&per, 2) == FERRY_OK && ferry_oldest(&per) == 3);
        CHECK(ferry_append(&per, big, 4, NULL) == FERRY_OK && per.meta.head == 9);
        CHECK(per.stats.deleted == 2);
    }
    /* unreadable event: discarded through it, counted, the replay goes on */
    fresh(60);
    add(5);
    st = ferry_ram_store_callbacks(&rs);
    st.read = read_fails_at_3;
    per.storage = st;
    ferry_conn_subscribe(&conn, 1);
    ctl_req(0, 10);
    ferry_pump(&conn, 0);
    kit_decode(link_.stream, link_.len, &d);
    CHECK(seqs_are(&d, 1, 2) && per.stats.read_errors == 0); /* stops in front of it: 1, 2 not yet acked */
    CHECK(ferry_oldest(&per) == 1);
    link_.len = 0;
    ctl_ack(2);
    ferry_pump(&conn, 0);
    kit_decode(link_.stream, link_.len, &d);
    CHECK(seqs_are(&d, 4, 5) && per.stats.read_errors == 1);
    CHECK(ferry_oldest(&per) == 4); /* the gateway sees 3 missing: a GAP */
}

int main(void) {
    test_codec();
    test_control_parser();
    test_replay_packing();
    test_window_ack_and_below();
    test_ack_beyond_sent();
    test_disconnect_mid_frame_and_new_req();
    test_live_and_flow();
    test_persistence();
    test_errors();
    printf("ferry_sync unit tests: %u passed, %u failed\n", passed, failed);
    return failed ? 1 : 0;
}

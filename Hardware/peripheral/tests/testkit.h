/* Shared by the unit tests and the fuzz target: a fake transport that records the DATA byte stream, and
 * a gateway-side stream decoder (PROTOCOL.md decoder rules) to read it back. Test code, not library. */
#ifndef FERRY_TESTKIT_H
#define FERRY_TESTKIT_H

#include <string.h>

#include "../ferry_sync.h"
#include "../ferry_ram_store.h"

#define KIT_STREAM_MAX (1u << 20)

typedef struct {
    uint16_t mtu;
    int can_send;     /* 0: flow control says stop */
    int busy_every;   /* >0: every Nth notify attempt answers BUSY */
    int fail;         /* notify fails for good */
    unsigned attempts, notes;
    uint16_t max_note, min_note;
    size_t len;
    uint8_t stream[KIT_STREAM_MAX];
} kit_link;

static int kit_notify(void *ctx, const uint8_t *d, uint16_t n) {
    kit_link *l = (kit_link *)ctx;
    l->attempts++;
    if (l->fail) return FERRY_ERR_LINK;
    if (l->busy_every > 0 && l->attempts % (unsigned)l->busy_every == 0) return FERRY_ERR_BUSY;
    if (n == 0 || n > l->mtu - 3 || l->len + n > KIT_STREAM_MAX) return FERRY_ERR_LINK; /* caught by the tests */
    memcpy(l->stream + l->len, d, n);
    l->len += n;
    l->notes++;
    if (n > l->max_note) l->max_note = n;
    if (l->min_note == 0 || n < l->min_note) l->min_note = n;
    return FERRY_OK;
}
static uint16_t kit_mtu(void *ctx) { return ((kit_link *)ctx)->mtu; }
static int kit_can_send(void *ctx) { return ((kit_link *)ctx)->can_send; }

static ferry_transport kit_transport(kit_link *l) {
    ferry_transport t;
    t.ctx = l;
    t.notify = kit_notify;
    t.mtu = kit_mtu;
    t.can_send = kit_can_send;
    return t;
}

static void kit_link_reset(kit_link *l, uint16_t mtu) {
    memset(l, 0, sizeof *l);
    l->mtu = mtu;
    l->can_send = 1;
}

static uint64_t kit_rng_state = 0x9E3779B97F4A7C15ull;
static int kit_random(void *ctx, uint8_t out[8]) {
    int i;
    (void)ctx;
    for (i = 0; i < 8; i++) {
        kit_rng_state ^= kit_rng_state << 13;
        kit_rng_state ^= kit_rng_state >> 7;
        kit_rng_state ^= kit_rng_state << 17;
        out[i] = (uint8_t)kit_rng_state;
    }
    return FERRY_OK;
}

/* Deterministic payload of event seq: a test can recompute what it must carry. */
static uint16_t kit_payload(uint64_t seq, uint8_t *out) {
    uint16_t n = (uint16_t)(seq * 7u % 60u), i;
    for (i = 0; i < n; i++) out[i] = (uint8_t)(seq + i);
    return n;
}

typedef struct {
    uint64_t seq[8192];
    unsigned frames;
    unsigned bad;       /* bytes dropped while resyncing */
    unsigned tail;      /* bytes of an incomplete frame at the end */
    int payload_ok;     /* every frame carried kit_payload(seq) */
    int type_ok;        /* every frame was DATA */
} kit_decoded;

/* Strict-ish decoder: scans for frames like the gateway (drop one byte on a bad candidate). */
static void kit_decode(const uint8_t *s, size_t len, kit_decoded *out) {
    size_t i = 0;
    memset(out, 0, sizeof *out);
    out->payload_ok = out->type_ok = 1;
    while (i < len) {
        uint16_t n;
        if (s[i] != FERRY_MAGIC) { out->bad++; i++; continue; }
        /* an incomplete frame at the end: the rest is still on its way (the gateway waits for it) */
        if (len - i < FERRY_OVERHEAD) { out->tail = (unsigned)(len - i); return; }
        n = (uint16_t)((s[i + 10] << 8) | s[i + 11]);
        if (n <= 4096 && len - i < (size_t)FERRY_OVERHEAD + n) { out->tail = (unsigned)(len - i); return; }
        if (n > 4096 ||
            ((uint16_t)((s[i + 12 + n] << 8) | s[i + 13 + n])) != ferry_crc16(0xFFFF, s + i, 12u + n)) {
            out->bad++; i++; continue;
        }
        {
            uint64_t seq = 0;
            uint8_t want[64];
            int k;
            for (k = 0; k < 8; k++) seq = (seq << 8) | s[i + 2 + k];
            if (s[i + 1] != FERRY_TYPE_DATA) out->type_ok = 0;
            if (kit_payload(seq, want) != n || memcmp(want, s + i + 12, n) != 0) out->payload_ok = 0;
            if (out->frames < 8192) out->seq[out->frames] = seq;
            out->frames++;
        }
        i += (size_t)FERRY_OVERHEAD + n;
    }
}

static size_t kit_req(uint8_t *out, uint64_t last, uint16_t window) {
    uint8_t w[2];
    w[0] = (uint8_t)(window >> 8);
    w[1] = (uint8_t)window;
    return ferry_encode_frame(out, 32, FERRY_TYPE_SYNC_REQ, last, w, 2);
}
static size_t kit_ack(uint8_t *out, uint64_t seq) { return ferry_encode_frame(out, 32, FERRY_TYPE_SYNC_ACK, seq, NULL, 0); }

#endif

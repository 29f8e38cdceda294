/* ferry_sync — see ferry_sync.h and README.md (decisions are listed there, with the reasons). */
#include "ferry_sync.h"

#include <string.h>

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

static void put64(uint8_t *p, uint64_t v) {
    int i;
    for (i = 7; i >= 0; i--) {
        p[i] = (uint8_t)v;
        v >>= 8;
    }
}

static uint16_t get16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }

static uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    int i;
    for (i = 0; i < 8; i++) v = (v << 8) | p[i];
    return v;
}

uint16_t ferry_crc16(uint16_t crc, const uint8_t *data, size_t len) {
    size_t i;
    int b;
    for (i = 0; i < len; i++) {
        crc ^= (uint16_t)(data[i] << 8);
        for (b = 0; b < 8; b++) crc = (crc & 0x8000u) ? (uint16_t)((crc << 1) ^ 0x1021u) : (uint16_t)(crc << 1);
    }
    return crc;
}

size_t ferry_encode_frame(uint8_t *out, size_t cap, uint8_t type, uint64_t seq, const uint8_t *payload,
                          size_t len) {
    if (out == NULL || len > 0xFFFFu || cap < FERRY_OVERHEAD + len || (len > 0 && payload == NULL)) return 0;
    out[0] = FERRY_MAGIC;
    out[1] = type;
    put64(out + 2, seq);
    put16(out + 10, (uint16_t)len);
    /* memmove: the state machine reads payloads straight into out + 12. */
    if (len > 0 && payload != out + FERRY_HEADER_LEN) memmove(out + FERRY_HEADER_LEN, payload, len);
    put16(out + FERRY_HEADER_LEN + len, ferry_crc16(0xFFFFu, out, FERRY_HEADER_LEN + len));
    return FERRY_OVERHEAD + len;
}

void ferry_encode_stream_info(uint8_t out[FERRY_STREAM_INFO_LEN], uint64_t epoch, uint64_t oldest,
                              uint64_t head) {
    out[0] = 1; /* version */
    out[1] = 0; /* flags */
    put64(out + 2, epoch);
    put64(out + 10, oldest);
    put64(out + 18, head);
}

ferry_control ferry_parse_control(const uint8_t *data, size_t len) {
    ferry_control c;
    size_t n;
    c.type = 0;
    c.seq = 0;
    c.window = 0;
    if (data == NULL || len < FERRY_OVERHEAD) {
        c.kind = FERRY_CTL_SHORT;
        return c;
    }
    if (data[0] != FERRY_MAGIC) {
        c.kind = FERRY_CTL_BAD_MAGIC;
        return c;
    }
    n = get16(data + 10);
    if (len != FERRY_OVERHEAD + n) {
        c.kind = FERRY_CTL_LENGTH_MISMATCH;
        return c;
    }
    if (get16(data + FERRY_HEADER_LEN + n) != ferry_crc16(0xFFFFu, data, FERRY_HEADER_LEN + n)) {
        c.kind = FERRY_CTL_BAD_CRC;
        return c;
    }
    c.type = data[1];
    c.seq = get64(data + 2);
    if (c.type == FERRY_TYPE_SYNC_REQ) {
        if (n != 2) {
            c.kind = FERRY_CTL_BAD_REQ_PAYLOAD;
            return c;
        }
        c.window = get16(data + FERRY_HEADER_LEN);
        c.kind = c.window == 0 ? FERRY_CTL_WINDOW_ZERO : FERRY_CTL_SYNC_REQ;
    } else if (c.type == FERRY_TYPE_SYNC_ACK) {
        c.kind = n == 0 ? FERRY_CTL_SYNC_ACK : FERRY_CTL_BAD_ACK_PAYLOAD;
    } else {
        c.kind = FERRY_CTL_UNEXPECTED_TYPE;
    }
    return c;
}

/* ---------------------------------------------------------------- store */

static int persist(ferry_peripheral *p, const ferry_meta *m) {
    if (p->storage.persist(p->storage.ctx, m) != FERRY_OK) return FERRY_ERR_STORAGE;
    p->meta = *m;
    return FERRY_OK;
}

static int new_epoch(ferry_peripheral *p, uint64_t *epoch) {
    uint8_t b[8];
    int attempt;
    /* Epoch 0 means "no STREAM_INFO" to the gateway: never use it. */
    for (attempt = 0; attempt < 4; attempt++) {
        if (p->random == NULL || p->random(p->random_ctx, b) != FERRY_OK) return FERRY_ERR_RANDOM;
        *epoch = get64(b);
        if (*epoch != 0) return FERRY_OK;
    }
    return FERRY_ERR_RANDOM;
}

int ferry_wipe(ferry_peripheral *p) {
    ferry_meta m;
    int rc;
    if (p == NULL) return FERRY_ERR_ARG;
    rc = new_epoch(p, &m.epoch);
    if (rc != FERRY_OK) return rc;
    m.head = 0;
    m.deleted_through = 0;
    p->sent_max = 0; /* seqs of the old stream mean nothing in the new one */
    return persist(p, &m);
}

int ferry_init(ferry_peripheral *p, const ferry_storage *storage, ferry_random_fn random, void *random_ctx,
               const ferry_meta *loaded) {
    if (p == NULL || storage == NULL || storage->append == NULL || storage->read == NULL ||
        storage->delete_through == NULL || storage->persist == NULL)
        return FERRY_ERR_ARG;
    memset(p, 0, sizeof *p);
    p->storage = *storage;
    p->random = random;
    p->random_ctx = random_ctx;
    if (loaded == NULL || loaded->epoch == 0) return ferry_wipe(p);
    p->meta = *loaded;
    if (p->meta.deleted_through > p->meta.head) {
        ferry_meta m = p->meta;
        m.deleted_through = m.head;
        return persist(p, &m);
    }
    return FERRY_OK;
}

int ferry_append(ferry_peripheral *p, const uint8_t *data, uint16_t len, uint64_t *seq_out) {
    ferry_meta m;
    uint64_t seq;
    int rc;
    if (p == NULL || len > FERRY_MAX_PAYLOAD || (len > 0 && data == NULL)) return FERRY_ERR_ARG;
    if (p->meta.head == UINT64_MAX) return FERRY_ERR_FULL;
    seq = p->meta.head + 1;
    /* Record first, counter second: until persist() says head = seq the record is not an event, so a
     * power cut in between only means seq is written again, never that a visible seq is reused. */
    rc = p->storage.append(p->storage.ctx, seq, data, len);
    if (rc != FERRY_OK) return rc == FERRY_ERR_FULL ? FERRY_ERR_FULL : FERRY_ERR_STORAGE;
    m = p->meta;
    m.head = seq;
    rc = persist(p, &m);
    if (rc != FERRY_OK) return rc;
    if (seq_out != NULL) *seq_out = seq;
    return FERRY_OK;
}

int ferry_discard_through(ferry_peripheral *p, uint64_t seq) {
    ferry_meta m;
    uint64_t before;
    int rc;
    if (p == NULL) return FERRY_ERR_ARG;
    if (seq > p->meta.head) seq = p->meta.head;
    if (seq <= p->meta.deleted_through) return FERRY_OK;
    before = p->meta.deleted_through;
    /* Meta first: a power cut before the records are freed leaves garbage behind deleted_through
     * (harmless); the other order would leave a retained range with holes in it. */
    m = p->meta;
    m.deleted_through = seq;
    rc = persist(p, &m);
    if (rc != FERRY_OK) return rc;
    p->stats.deleted += seq - before;
    return p->storage.delete_through(p->storage.ctx, seq) == FERRY_OK ? FERRY_OK : FERRY_ERR_STORAGE;
}

uint64_t ferry_oldest(const ferry_peripheral *p) {
    return p->meta.deleted_through < p->meta.head ? p->meta.deleted_through + 1 : 0;
}

void ferry_stream_info(const ferry_peripheral *p, uint8_t out[FERRY_STREAM_INFO_LEN]) {
    ferry_encode_stream_info(out, p->meta.epoch, ferry_oldest(p), p->meta.head);
}

/* ---------------------------------------------------------------- connection */

void ferry_conn_open(ferry_conn *c, ferry_peripheral *p, const ferry_transport *t) {
    memset(c, 0, sizeof *c);
    c->p = p;
    c->transport = *t;
    c->active = 1;
}

void ferry_conn_subscribe(ferry_conn *c, int enabled) {
    if (c->active) c->subscribed = enabled != 0;
}

void ferry_conn_close(ferry_conn *c) {
    /* A frame cut by the link loss is simply abandoned: the gateway's decoder drops the partial frame,
     * and the next connection's SYNC_REQ restarts from what it committed. Nothing is deleted. */
    ferry_peripheral *p = c->p;
    memset(c, 0, sizeof *c);
    c->p = p;
}

static uint64_t min64(uint64_t a, uint64_t b) { return a < b ? a : b; }
static uint64_t max64(uint64_t a, uint64_t b) { return a > b ? a : b; }

/* Releases events through ack, but never past what the gateway can have: the highest seq that left this
 * peripheral (on any connection since boot) or that this connection's SYNC_REQ claimed. Ferry writes
 * SYNC_ACK(stored cursor) on a new link BEFORE its SYNC_REQ (frames a dropped link delivered and it committed
 * without an ACK); after a reboot this peripheral no longer knows what left, so such an ACK waits for the
 * SYNC_REQ that follows and is applied as far as that request claims. */
static void apply_ack(ferry_conn *c, uint64_t ack) {
    ferry_peripheral *p = c->p;
    uint64_t bound = max64(c->proven, min64(p->sent_max, p->meta.head));
    if (ack > bound) {
        if (!c->requested) {
            c->deferred_ack = max64(c->deferred_ack, ack);
            ack = bound;
        } else {
            p->stats.ack_beyond_sent++;
            ack = bound;
        }
    }
    p->stats.highest_ack = max64(p->stats.highest_ack, ack);
    c->ack_base = max64(c->ack_base, ack);
    (void)ferry_discard_through(p, ack);
}

ferry_control_kind ferry_on_control(ferry_conn *c, const uint8_t *data, size_t len) {
    ferry_peripheral *p = c->p;
    ferry_control ctl = ferry_parse_control(data, len);
    if (!c->active || p == NULL) return ctl.kind;
    switch (ctl.kind) {
    case FERRY_CTL_SYNC_REQ:
        p->stats.sync_reqs++;
        if (ctl.seq > p->meta.head) p->stats.req_beyond_head++;
        c->requested = 1;
        c->window = ctl.window;
        /* Below the last ACK: what is deleted cannot be replayed, the window counts from what is retained
         * (the gateway learns the rest from STREAM_INFO's oldest). A new request replaces the replay; a
         * frame already partly sent is finished first so the byte stream stays whole. */
        c->ack_base = max64(ctl.seq, p->meta.deleted_through);
        c->next_seq = c->ack_base + 1 > c->ack_base ? c->ack_base + 1 : c->ack_base;
        /* The gateway says it holds everything through seq: an ACK up to there is believable. */
        c->proven = max64(c->proven, min64(ctl.seq, p->meta.head));
        if (c->deferred_ack != 0) {
            uint64_t ack = c->deferred_ack;
            c->deferred_ack = 0;
            apply_ack(c, ack);
        }
        break;
    case FERRY_CTL_SYNC_ACK:
        p->stats.acks++;
        apply_ack(c, ctl.seq);
        break;
    default:
        p->stats.control_errors[ctl.kind]++;
        break;
    }
    return ctl.kind;
}

/* Loads the next event the window allows into c->frame; 0 when there is none. */
static int load_next(ferry_conn *c) {
    ferry_peripheral *p = c->p;
    if (!c->subscribed || !c->requested) return 0;
    for (;;) {
        uint64_t limit;
        int n;
        if (c->next_seq <= p->meta.deleted_through) c->next_seq = p->meta.deleted_through + 1;
        limit = c->ack_base > UINT64_MAX - c->window ? p->meta.head : min64(p->meta.head, c->ack_base + c->window);
        if (c->next_seq == 0 || c->next_seq > limit) return 0;
        n = p->storage.read(p->storage.ctx, c->next_seq, c->frame + FERRY_HEADER_LEN, FERRY_MAX_PAYLOAD);
        if (n < 0 || n > (int)FERRY_MAX_PAYLOAD) {
            /* A retained event that cannot be read is lost. The only way to say so is STREAM_INFO's
             * oldest (the gateway then records a GAP), and the retained range must stay contiguous: so
             * stop in front of it until everything below is acknowledged, then discard it and go on,
             * rather than stall the replay on it forever or discard good unacknowledged events with it. */
            if (c->next_seq != p->meta.deleted_through + 1) return 0;
            p->stats.read_errors++;
            if (ferry_discard_through(p, c->next_seq) != FERRY_OK && p->meta.deleted_through < c->next_seq)
                return 0;
            continue;
        }
        c->frame_len = (uint16_t)ferry_encode_frame(c->frame, sizeof c->frame, FERRY_TYPE_DATA, c->next_seq,
                                                    c->frame + FERRY_HEADER_LEN, (size_t)n);
        c->frame_off = 0;
        c->cur_seq = c->next_seq++;
        return 1;
    }
}

static uint16_t note_limit(const ferry_conn *c) {
    uint16_t mtu = c->transport.mtu != NULL ? c->transport.mtu(c->transport.ctx) : 23;
    uint16_t limit = mtu < 23 ? 20 : (uint16_t)(mtu - 3);
    return limit > FERRY_NOTIFY_MAX ? (uint16_t)FERRY_NOTIFY_MAX : limit;
}

int ferry_pump(ferry_conn *c, unsigned max_notifications) {
    unsigned sent = 0;
    if (!c->active || c->p == NULL) return 0;
    while (max_notifications == 0 || sent < max_notifications) {
        uint16_t limit = note_limit(c), out;
        int rc;
        if (c->transport.can_send != NULL && !c->transport.can_send(c->transport.ctx)) break;
        if (c->pending_len == 0) {
            uint16_t n = 0;
            /* Frames back to back; a frame that does not fit continues in the next notification. */
            while (n < limit) {
                uint16_t k;
                if (c->frame_off == c->frame_len && !load_next(c)) break;
                k = (uint16_t)(c->frame_len - c->frame_off);
                if (k > limit - n) k = (uint16_t)(limit - n);
                memcpy(c->note + n, c->frame + c->frame_off, k);
                n = (uint16_t)(n + k);
                c->frame_off = (uint16_t)(c->frame_off + k);
                if (c->frame_off == c->frame_len && c->cur_seq != 0) {
                    /* This notification carries the frame's last byte: it is sent when the note is. */
                    c->pend_frames++;
                    c->pend_max = c->cur_seq;
                    c->cur_seq = 0;
                }
            }
            if (n == 0) break;
            c->pending_len = n;
        }
        /* A note built before the MTU shrank (not possible in ATT, cheap to survive) goes in pieces. */
        out = c->pending_len < limit ? c->pending_len : limit;
        rc = c->transport.notify(c->transport.ctx, c->note, out);
        if (rc == FERRY_ERR_BUSY) break; /* the same bytes go first next time */
        if (rc != FERRY_OK) return FERRY_ERR_LINK; /* the integrator closes the connection */
        c->p->stats.notifications++;
        c->p->stats.bytes_sent += out;
        sent++;
        if (out < c->pending_len) {
            memmove(c->note, c->note + out, (size_t)(c->pending_len - out));
            c->pending_len = (uint16_t)(c->pending_len - out);
            continue;
        }
        c->p->stats.frames_sent += c->pend_frames;
        /* A frame counts as delivered (its seq acknowledgeable) once the note with its last byte left. */
        c->proven = max64(c->proven, c->pend_max);
        c->p->sent_max = max64(c->p->sent_max, c->pend_max);
        c->pending_len = 0;
        c->pend_frames = 0;
    }
    return (int)sent;
}

/*
 * ferry_sync — the peripheral side of Ferry's Sync protocol v1 (docs/PROTOCOL.md), in portable C99.
 *
 * No malloc, no OS, no Bluetooth stack: the integrator hands in storage, transport and random-source
 * callbacks (README.md in this directory is the porting guide). Not thread-safe: call every function of
 * one ferry_peripheral from one context (a BLE stack's callback thread, or with a mutex around them).
 *
 * Sizes are compile-time (override with -D):
 *   FERRY_MAX_PAYLOAD   largest event payload this build stores/sends (gateway default cap 4096)
 *   FERRY_NOTIFY_MAX    largest notification assembled (ATT MTU - 3 is also respected at run time)
 *   FERRY_MAX_CONNS     connections served at once by one peripheral (typically 1)
 */
#ifndef FERRY_SYNC_H
#define FERRY_SYNC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifndef FERRY_MAX_PAYLOAD
#define FERRY_MAX_PAYLOAD 244
#endif
#ifndef FERRY_NOTIFY_MAX
#define FERRY_NOTIFY_MAX 244
#endif

#define FERRY_MAGIC 0xA5u
#define FERRY_TYPE_SYNC_REQ 0x01u
#define FERRY_TYPE_SYNC_ACK 0x02u
#define FERRY_TYPE_DATA 0x03u
#define FERRY_HEADER_LEN 12u
#define FERRY_OVERHEAD 14u /* header + CRC */
#define FERRY_STREAM_INFO_LEN 26u
#define FERRY_FRAME_MAX (FERRY_OVERHEAD + FERRY_MAX_PAYLOAD)
/* The longest CONTROL write that can be valid: a SYNC_REQ (2-byte window). */
#define FERRY_CONTROL_MAX (FERRY_OVERHEAD + 2u)

#if FERRY_MAX_PAYLOAD > 4096 || FERRY_MAX_PAYLOAD < 1
#error "FERRY_MAX_PAYLOAD must be 1..4096 (Ferry's decoder treats longer frames as noise)"
#endif
#if FERRY_NOTIFY_MAX < 20 || FERRY_NOTIFY_MAX > 514
#error "FERRY_NOTIFY_MAX must be 20..514 (ATT MTU 23..517)"
#endif

/* Results. 0 is success; everything else is negative so callbacks can return lengths. */
typedef enum {
    FERRY_OK = 0,
    FERRY_ERR_ARG = -1,       /* bad argument (NULL, payload too long, MTU < 23) */
    FERRY_ERR_STORAGE = -2,   /* a storage callback failed; nothing became visible */
    FERRY_ERR_FULL = -3,      /* the store has no room (see ferry_discard_through) */
    FERRY_ERR_RANDOM = -4,    /* the random source failed or kept returning 0 */
    FERRY_ERR_NOT_FOUND = -5, /* storage: seq not retained */
    FERRY_ERR_BUSY = -6,      /* transport: cannot take a notification now */
    FERRY_ERR_LINK = -7       /* transport: notify failed for good (link gone) */
} ferry_result;

/* What a CONTROL write was, or why it was refused. Every malformed case has its own value. */
typedef enum {
    FERRY_CTL_SYNC_REQ = 0,
    FERRY_CTL_SYNC_ACK,
    FERRY_CTL_SHORT,            /* fewer than 14 bytes */
    FERRY_CTL_BAD_MAGIC,        /* first byte is not 0xA5 */
    FERRY_CTL_LENGTH_MISMATCH,  /* payload length field disagrees with the write's length */
    FERRY_CTL_BAD_CRC,
    FERRY_CTL_UNEXPECTED_TYPE,  /* valid frame, but DATA or an unknown type: not for CONTROL */
    FERRY_CTL_BAD_REQ_PAYLOAD,  /* SYNC_REQ whose payload is not exactly 2 bytes */
    FERRY_CTL_BAD_ACK_PAYLOAD,  /* SYNC_ACK with a payload */
    FERRY_CTL_WINDOW_ZERO,      /* SYNC_REQ with window 0 (see README: decisions) */
    FERRY_CTL_KINDS
} ferry_control_kind;

typedef struct {
    ferry_control_kind kind;
    uint8_t type;
    uint64_t seq;
    uint16_t window; /* SYNC_REQ only */
} ferry_control;

/* ---------------------------------------------------------------- codec (pure functions) */

/* CRC-16/IBM-3740: poly 0x1021, init 0xFFFF (pass 0xFFFF as crc to start), no reflection, xorout 0. */
uint16_t ferry_crc16(uint16_t crc, const uint8_t *data, size_t len);

/* Writes one frame; returns its length (14 + len) or 0 if cap is too small / len > 65535. */
size_t ferry_encode_frame(uint8_t *out, size_t cap, uint8_t type, uint64_t seq, const uint8_t *payload,
                          size_t len);

/* STREAM_INFO value: version 1 · flags 0 · epoch · oldest (0 = none) · head; always 26 bytes. */
void ferry_encode_stream_info(uint8_t out[FERRY_STREAM_INFO_LEN], uint64_t epoch, uint64_t oldest,
                              uint64_t head);

/* Parses one CONTROL write (exactly one frame). Never reads past len; any byte string is safe. */
ferry_control ferry_parse_control(const uint8_t *data, size_t len);

/* ---------------------------------------------------------------- callbacks */

/* What must survive power loss besides the events themselves. */
typedef struct {
    uint64_t epoch;           /* random, never 0; new only when the store is wiped */
    uint64_t head;            /* highest seq ever made visible (0: none yet) */
    uint64_t deleted_through; /* every seq <= this is deleted (released by a SYNC_ACK or discarded) */
} ferry_meta;

typedef struct {
    void *ctx;
    /* Store event `seq` (always head + 1). Durable before returning if it must survive power loss.
     * Returns FERRY_OK, FERRY_ERR_FULL or FERRY_ERR_STORAGE. A record written here is not an event
     * until persist() has recorded head = seq: after a power cut in between, seq is simply reused. */
    int (*append)(void *ctx, uint64_t seq, const uint8_t *data, uint16_t len);
    /* Copy event `seq` into buf (cap = FERRY_MAX_PAYLOAD bytes); returns its length, FERRY_ERR_NOT_FOUND
     * if it is not stored, or FERRY_ERR_STORAGE (unreadable: the library then discards through seq). */
    int (*read)(void *ctx, uint64_t seq, uint8_t *buf, uint16_t cap);
    /* Free every event <= seq. Called AFTER persist() recorded deleted_through >= seq. */
    int (*delete_through)(void *ctx, uint64_t seq);
    /* Durably record meta (epoch, head, deleted_through). FERRY_OK or FERRY_ERR_STORAGE. */
    int (*persist)(void *ctx, const ferry_meta *meta);
} ferry_storage;

typedef struct {
    void *ctx;
    /* Send one DATA notification of len bytes (1..MTU-3). FERRY_OK when the stack took it (copied or
     * queued), FERRY_ERR_BUSY to retry the SAME bytes later, any other value: link unusable. */
    int (*notify)(void *ctx, const uint8_t *data, uint16_t len);
    /* Current ATT MTU of this connection (23 before an exchange). */
    uint16_t (*mtu)(void *ctx);
    /* Nonzero if a notification can be queued now (flow control); NULL = always. */
    int (*can_send)(void *ctx);
} ferry_transport;

/* Fills out with 8 random bytes; FERRY_OK or an error. Used once per store wipe (new epoch). */
typedef int (*ferry_random_fn)(void *ctx, uint8_t out[8]);

/* ---------------------------------------------------------------- state */

typedef struct {
    uint32_t sync_reqs, acks, frames_sent, notifications, bytes_sent;
    uint32_t control_errors[FERRY_CTL_KINDS]; /* indexed by ferry_control_kind (REQ/ACK slots unused) */
    uint32_t req_beyond_head;  /* SYNC_REQ seq > head (gateway thinks we had more: regression) */
    uint32_t ack_beyond_sent;  /* SYNC_ACK above anything sent or claimed: clamped */
    uint32_t read_errors;      /* unreadable events discarded */
    uint64_t highest_ack, deleted;
} ferry_stats;

struct ferry_peripheral;

/* One connection's session. Lives in the integrator's memory (static, or in its connection object). */
typedef struct {
    struct ferry_peripheral *p;
    ferry_transport transport;
    uint8_t active, subscribed, requested;
    uint16_t window;
    uint64_t ack_base;  /* the window counts from here: max(SYNC_REQ seq, last ACK, deleted_through) */
    uint64_t next_seq;  /* next event to frame */
    uint64_t proven;    /* highest seq this gateway showed it has: its SYNC_REQ seq or a frame fully sent */
    uint64_t deferred_ack; /* an ACK before this link's first SYNC_REQ that could not be believed yet */
    uint64_t cur_seq;   /* seq of the frame in frame[] until its last byte is in note[] (then 0) */
    uint16_t frame_len, frame_off; /* frame[] holds a frame being sent; frame_off bytes are out */
    uint16_t pending_len;          /* a notification the stack refused (BUSY), resent first */
    uint16_t pend_frames;          /* frames whose last byte is in note[] */
    uint64_t pend_max;             /* highest such seq */
    uint8_t frame[FERRY_FRAME_MAX];
    uint8_t note[FERRY_NOTIFY_MAX];
} ferry_conn;

typedef struct ferry_peripheral {
    ferry_storage storage;
    ferry_random_fn random;
    void *random_ctx;
    ferry_meta meta;
    ferry_stats stats;
    uint64_t sent_max; /* highest seq whose frame fully left on any connection since init/wipe (RAM only) */
} ferry_peripheral;

/* Starts from persisted meta (NULL, or epoch 0: a fresh/wiped store -> new epoch, persisted at once).
 * meta->deleted_through > meta->head is repaired (clamped). */
int ferry_init(ferry_peripheral *p, const ferry_storage *storage, ferry_random_fn random, void *random_ctx,
               const ferry_meta *loaded);

/* A new event: stored, head persisted, then visible (sent to subscribed connections by ferry_pump). */
int ferry_append(ferry_peripheral *p, const uint8_t *data, uint16_t len, uint64_t *seq_out);

/* The store was wiped (factory reset, corrupt storage): new epoch, head 0, seq restarts at 1.
 * The integrator erases its event storage first; connections should be dropped (the gateway's ACKs
 * would name the old stream). */
int ferry_wipe(ferry_peripheral *p);

/* Give up events <= seq without an ACK (store full, data too old). The gateway sees them missing in
 * STREAM_INFO (oldest) and records a GAP: visible loss, never silent. */
int ferry_discard_through(ferry_peripheral *p, uint64_t seq);

uint64_t ferry_oldest(const ferry_peripheral *p); /* 0 = nothing retained */
void ferry_stream_info(const ferry_peripheral *p, uint8_t out[FERRY_STREAM_INFO_LEN]);

/* Connection lifecycle. */
void ferry_conn_open(ferry_conn *c, ferry_peripheral *p, const ferry_transport *t);
void ferry_conn_subscribe(ferry_conn *c, int enabled); /* DATA CCCD written */
void ferry_conn_close(ferry_conn *c); /* link lost, possibly mid-frame: the partial frame is abandoned */

/* A CONTROL write; returns what it was (malformed writes change nothing, and are counted). */
ferry_control_kind ferry_on_control(ferry_conn *c, const uint8_t *data, size_t len);

/* Sends what the protocol allows: up to max_notifications (0 = until can_send says stop, the window is
 * full or nothing is left). Returns notifications sent, or a negative ferry_result from the transport.
 * Call after ferry_on_control, ferry_append, ferry_conn_subscribe and whenever the stack can take more. */
int ferry_pump(ferry_conn *c, unsigned max_notifications);

#ifdef __cplusplus
}
#endif
#endif

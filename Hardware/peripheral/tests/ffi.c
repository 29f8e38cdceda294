/* Test-bed glue, compiled only into libferrysync.so: lets Python (ctypes, scripts/testbed.d/cengine.py)
 * size and read the library's structs without copying their layout, which depends on build options. */
#include "../ferry_sync.h"

size_t ferry_ffi_sizeof_peripheral(void);
size_t ferry_ffi_sizeof_conn(void);
void ferry_ffi_meta(const ferry_peripheral *p, ferry_meta *out);
/* Order: sync_reqs, acks, frames_sent, notifications, bytes_sent, req_beyond_head, ack_beyond_sent,
 * read_errors, highest_ack, deleted, then control_errors[FERRY_CTL_KINDS]. Returns how many were written. */
unsigned ferry_ffi_stats(const ferry_peripheral *p, uint64_t *out, unsigned cap);

size_t ferry_ffi_sizeof_peripheral(void) { return sizeof(ferry_peripheral); }
size_t ferry_ffi_sizeof_conn(void) { return sizeof(ferry_conn); }
void ferry_ffi_meta(const ferry_peripheral *p, ferry_meta *out) { *out = p->meta; }

unsigned ferry_ffi_stats(const ferry_peripheral *p, uint64_t *out, unsigned cap) {
    uint64_t v[10 + FERRY_CTL_KINDS];
    unsigned i, n = 0;
    v[n++] = p->stats.sync_reqs;
    v[n++] = p->stats.acks;
    v[n++] = p->stats.frames_sent;
    v[n++] = p->stats.notifications;
    v[n++] = p->stats.bytes_sent;
    v[n++] = p->stats.req_beyond_head;
    v[n++] = p->stats.ack_beyond_sent;
    v[n++] = p->stats.read_errors;
    v[n++] = p->stats.highest_ack;
    v[n++] = p->stats.deleted;
    for (i = 0; i < FERRY_CTL_KINDS; i++) v[n++] = p->stats.control_errors[i];
    for (i = 0; i < n && i < cap; i++) out[i] = v[i];
    return i;
}

#include "ferry_ram_store.h"

#include <string.h>

#define SLOT_SIZE(s) ((size_t)(s)->slot_payload + 2u)

int ferry_ram_store_init(ferry_ram_store *s, uint8_t *buf, size_t buf_len, uint16_t slot_payload) {
    size_t slots;
    if (s == NULL || buf == NULL || slot_payload == 0) return FERRY_ERR_ARG;
    memset(s, 0, sizeof *s);
    slots = buf_len / ((size_t)slot_payload + 2u);
    if (slots == 0) return FERRY_ERR_ARG;
    s->buf = buf;
    s->slots = slots > UINT32_MAX ? UINT32_MAX : (uint32_t)slots;
    s->slot_payload = slot_payload;
    return FERRY_OK;
}

static uint8_t *slot(ferry_ram_store *s, uint64_t seq) { return s->buf + (size_t)(seq % s->slots) * SLOT_SIZE(s); }

static int ram_append(void *ctx, uint64_t seq, const uint8_t *data, uint16_t len) {
    ferry_ram_store *s = (ferry_ram_store *)ctx;
    uint8_t *p;
    if (len > s->slot_payload) return FERRY_ERR_STORAGE;
    if (s->count == 0) {
        s->first = seq;
    } else if (seq != s->first + s->count) {
        /* A record written before a restart that never became an event (head was not persisted):
         * seq is being written again. Anything at or above seq is such a leftover. */
        if (seq < s->first || seq > s->first + s->count) return FERRY_ERR_STORAGE;
        s->count = seq - s->first;
        if (s->count == 0) s->first = seq;
    }
    if (s->count >= s->slots) return FERRY_ERR_FULL;
    p = slot(s, seq);
    p[0] = (uint8_t)(len >> 8);
    p[1] = (uint8_t)len;
    if (len) memcpy(p + 2, data, len);
    s->count++;
    return FERRY_OK;
}

static int ram_read(void *ctx, uint64_t seq, uint8_t *buf, uint16_t cap) {
    ferry_ram_store *s = (ferry_ram_store *)ctx;
    const uint8_t *p;
    uint16_t len;
    if (s->count == 0 || seq < s->first || seq - s->first >= s->count) return FERRY_ERR_NOT_FOUND;
    p = slot(s, seq);
    len = (uint16_t)((p[0] << 8) | p[1]);
    if (len > cap || len > s->slot_payload) return FERRY_ERR_STORAGE;
    memcpy(buf, p + 2, len);
    return len;
}

static int ram_delete_through(void *ctx, uint64_t seq) {
    ferry_ram_store *s = (ferry_ram_store *)ctx;
    if (s->count == 0 || seq < s->first) return FERRY_OK;
    if (seq - s->first >= s->count) {
        s->first = seq + 1;
        s->count = 0;
    } else {
        s->count -= seq - s->first + 1;
        s->first = seq + 1;
    }
    return FERRY_OK;
}

static int ram_persist(void *ctx, const ferry_meta *m) {
    ferry_ram_store *s = (ferry_ram_store *)ctx;
    s->meta = *m;
    s->has_meta = 1;
    return FERRY_OK;
}

ferry_storage ferry_ram_store_callbacks(ferry_ram_store *s) {
    ferry_storage st;
    st.ctx = s;
    st.append = ram_append;
    st.read = ram_read;
    st.delete_through = ram_delete_through;
    st.persist = ram_persist;
    return st;
}

const ferry_meta *ferry_ram_store_meta(const ferry_ram_store *s) { return s->has_meta ? &s->meta : NULL; }

void ferry_ram_store_erase(ferry_ram_store *s) {
    s->first = 0;
    s->count = 0;
    s->has_meta = 0;
    memset(&s->meta, 0, sizeof s->meta);
}

/*
 * A ready RAM implementation of ferry_storage: fixed-size slots in a buffer the integrator provides
 * (no malloc). Events [first, head] occupy consecutive slots of a ring. Its meta lives in the struct, so
 * it survives a ferry_init() restart as long as the memory does (retained RAM), not a power cut: for
 * that, see the flash-ring recipe in README.md.
 */
#ifndef FERRY_RAM_STORE_H
#define FERRY_RAM_STORE_H

#include "ferry_sync.h"

typedef struct {
    uint8_t *buf;
    uint32_t slots;       /* capacity in events */
    uint16_t slot_payload; /* largest payload a slot holds */
    uint64_t first, count; /* events first .. first+count-1 are stored */
    ferry_meta meta;       /* last persisted meta */
    int has_meta;
} ferry_ram_store;

/* buf_len / (slot_payload + 2) slots. Returns FERRY_ERR_ARG if that is 0 or slot_payload is 0. */
int ferry_ram_store_init(ferry_ram_store *s, uint8_t *buf, size_t buf_len, uint16_t slot_payload);
/* The callbacks, with s as ctx. */
ferry_storage ferry_ram_store_callbacks(ferry_ram_store *s);
/* The meta to hand ferry_init (NULL if nothing was persisted yet). */
const ferry_meta *ferry_ram_store_meta(const ferry_ram_store *s);
/* Erase every event and the meta (factory reset); then call ferry_wipe. */
void ferry_ram_store_erase(ferry_ram_store *s);

#endif

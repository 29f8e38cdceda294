/*
 * Baselines for scripts/bench, compiled in the same run as the Swift code they are compared with.
 *
 *   ingest_baseline capture FILE N PAYLOAD     write N valid DATA frames (seq 1..N) to FILE
 *   ingest_baseline sqlite DB N PAYLOAD        the SQLite work of `ferry ingest` on an existing Ferry store,
 *                                              done by a plain C loop: per 20-frame window one BEGIN IMMEDIATE,
 *                                              cursor read, FRAMES outbox insert, 20 frame inserts, cursor
 *                                              update, COMMIT (journal_mode=WAL, synchronous=FULL)
 */
#include <sqlite3.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint16_t table[256];
static void crc_init(void) {
    for (int b = 0; b < 256; b++) {
        uint16_t c = (uint16_t)(b << 8);
        for (int i = 0; i < 8; i++) c = (c & 0x8000) ? (uint16_t)((c << 1) ^ 0x1021) : (uint16_t)(c << 1);
        table[b] = c;
    }
}
static uint16_t crc16(const uint8_t *p, size_t n) {
    uint16_t c = 0xFFFF;
    for (size_t i = 0; i < n; i++) c = (uint16_t)((c << 8) ^ table[(uint8_t)((c >> 8) ^ p[i])]);
    return c;
}

static void payload_for(uint64_t seq, uint8_t *out, int n) {
    uint64_t x = seq * 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < n; i++) { x ^= x >> 29; x *= 0xBF58476D1CE4E5B9ull; out[i] = (uint8_t)(x >> 56); }
}

static int write_capture(const char *path, long n, int payload) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); return 1; }
    uint8_t frame[14 + 65535];
    for (long s = 1; s <= n; s++) {
        uint64_t seq = (uint64_t)s;
        frame[0] = 0xA5; frame[1] = 0x03;
        for (int i = 0; i < 8; i++) frame[2 + i] = (uint8_t)(seq >> (56 - 8 * i));
        frame[10] = (uint8_t)(payload >> 8); frame[11] = (uint8_t)payload;
        payload_for(seq, frame + 12, payload);
        uint16_t c = crc16(frame, 12 + (size_t)payload);
        frame[12 + payload] = (uint8_t)(c >> 8); frame[13 + payload] = (uint8_t)c;
        fwrite(frame, 1, 14 + (size_t)payload, f);
    }
    return fclose(f) == 0 ? 0 : 1;
}

#define CHECK(x) do { int rc_ = (x); if (rc_ != SQLITE_OK && rc_ != SQLITE_DONE && rc_ != SQLITE_ROW) { \
    fprintf(stderr, "sqlite %d: %s at %s:%d\n", rc_, sqlite3_errmsg(db), __FILE__, __LINE__); exit(1); } } while (0)

static int sqlite_loop(const char *path, long n, int payload) {
    sqlite3 *db;
    CHECK(sqlite3_open(path, &db));
    CHECK(sqlite3_exec(db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;", 0, 0, 0));
    const char *peripheral = "C0:FF:EE:00:00:02", *epoch = "0";
    CHECK(sqlite3_exec(db, "INSERT OR IGNORE INTO stream_cursors (peripheral, epoch, device_epoch, cursor, active, "
        "created_at, updated_at) VALUES ('C0:FF:EE:00:00:02', '0', '0', 0, 1, 0, 0)", 0, 0, 0));
    sqlite3_stmt *sel, *outbox, *frame, *upd, *begin, *commit;
    CHECK(sqlite3_prepare_v2(db, "SELECT cursor FROM stream_cursors WHERE peripheral = ? AND epoch = ?", -1, &sel, 0));
    CHECK(sqlite3_prepare_v2(db, "INSERT INTO outbox_events (id, event_type, payload, status, retry_count, next_retry_at, "
        "created_at, peripheral, epoch, first_seq, last_seq, frame_count, payload_bytes) "
        "VALUES (?, 'FRAMES', ?, 'PENDING', 0, ?, ?, ?, ?, ?, ?, ?, ?)", -1, &outbox, 0));
    CHECK(sqlite3_prepare_v2(db, "INSERT INTO staged_frames (peripheral, epoch, seq, payload, received_at, outbox_id) "
        "VALUES (?, ?, ?, ?, ?, ?)", -1, &frame, 0));
    CHECK(sqlite3_prepare_v2(db, "UPDATE stream_cursors SET cursor = ?, updated_at = ? WHERE peripheral = ? AND epoch = ?",
        -1, &upd, 0));
    CHECK(sqlite3_prepare_v2(db, "BEGIN IMMEDIATE", -1, &begin, 0));
    CHECK(sqlite3_prepare_v2(db, "COMMIT", -1, &commit, 0));
    uint8_t buf[65535];
    char id[64], json[256];
    for (long first = 1; first <= n; first += 20) {
        long last = first + 19 > n ? n : first + 19;
        CHECK(sqlite3_step(begin)); sqlite3_reset(begin);
        sqlite3_bind_text(sel, 1, peripheral, -1, SQLITE_STATIC); sqlite3_bind_text(sel, 2, epoch, -1, SQLITE_STATIC);
        CHECK(sqlite3_step(sel)); sqlite3_reset(sel);
        long now = (long)time(0) * 1000;
        snprintf(id, sizeof id, "%08lx-0000-4000-8000-%012lx", first, first);
        snprintf(json, sizeof json, "{\"peripheral\":\"%s\",\"epoch\":\"%s\",\"first_seq\":\"%ld\",\"last_seq\":\"%ld\",\"count\":%ld}",
            peripheral, epoch, first, last, last - first + 1);
        sqlite3_bind_text(outbox, 1, id, -1, SQLITE_TRANSIENT); sqlite3_bind_text(outbox, 2, json, -1, SQLITE_TRANSIENT);
        sqlite3_bind_int64(outbox, 3, now); sqlite3_bind_int64(outbox, 4, now);
        sqlite3_bind_text(outbox, 5, peripheral, -1, SQLITE_STATIC); sqlite3_bind_text(outbox, 6, epoch, -1, SQLITE_STATIC);
        sqlite3_bind_int64(outbox, 7, first); sqlite3_bind_int64(outbox, 8, last);
        sqlite3_bind_int64(outbox, 9, last - first + 1); sqlite3_bind_int64(outbox, 10, (last - first + 1) * payload);
        CHECK(sqlite3_step(outbox)); sqlite3_reset(outbox);
        for (long s = first; s <= last; s++) {
            payload_for((uint64_t)s, buf, payload);
            sqlite3_bind_text(frame, 1, peripheral, -1, SQLITE_STATIC); sqlite3_bind_text(frame, 2, epoch, -1, SQLITE_STATIC);
            sqlite3_bind_int64(frame, 3, s); sqlite3_bind_blob(frame, 4, buf, payload, SQLITE_TRANSIENT);
            sqlite3_bind_int64(frame, 5, now); sqlite3_bind_text(frame, 6, id, -1, SQLITE_TRANSIENT);
            CHECK(sqlite3_step(frame)); sqlite3_reset(frame);
        }
        sqlite3_bind_int64(upd, 1, last); sqlite3_bind_int64(upd, 2, now);
        sqlite3_bind_text(upd, 3, peripheral, -1, SQLITE_STATIC); sqlite3_bind_text(upd, 4, epoch, -1, SQLITE_STATIC);
        CHECK(sqlite3_step(upd)); sqlite3_reset(upd);
        CHECK(sqlite3_step(commit)); sqlite3_reset(commit);
    }
    sqlite3_finalize(sel); sqlite3_finalize(outbox); sqlite3_finalize(frame); sqlite3_finalize(upd);
    sqlite3_finalize(begin); sqlite3_finalize(commit);
    return sqlite3_close(db) == SQLITE_OK ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: %s capture|sqlite PATH N PAYLOAD\n", argv[0]); return 2; }
    crc_init();
    long n = atol(argv[3]);
    int payload = atoi(argv[4]);
    if (strcmp(argv[1], "capture") == 0) return write_capture(argv[2], n, payload);
    if (strcmp(argv[1], "sqlite") == 0) return sqlite_loop(argv[2], n, payload);
    return 2;
}

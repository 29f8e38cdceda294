/* Baseline for scripts/bench-decoder: a table-driven CRC-16/IBM-3740 pass (byte at a time, the classic
 * 256-entry table) over the same bytes the Swift decoder parses. Usage: crc16 FILE PASSES
 * Prints "c-crc16 <best MB/s> <crc>" (MB = 10^6 bytes); the crc is printed so the loop cannot be elided. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static uint16_t table[256];

static void build_table(void) {
    for (int b = 0; b < 256; b++) {
        uint16_t crc = (uint16_t)(b << 8);
        for (int i = 0; i < 8; i++) crc = (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
        table[b] = crc;
    }
}

static uint16_t crc16(uint16_t crc, const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) crc = (uint16_t)((crc << 8) ^ table[(uint8_t)(crc >> 8) ^ p[i]]);
    return crc;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s FILE PASSES\n", argv[0]); return 2; }
    FILE *f = fopen(argv[1], "rb");
    if (!f) { perror(argv[1]); return 1; }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)size);
    if (!buf || fread(buf, 1, (size_t)size, f) != (size_t)size) { fprintf(stderr, "read failed\n"); return 1; }
    fclose(f);
    build_table();
    if (crc16(0xFFFF, (const uint8_t *)"123456789", 9) != 0x29B1) { fprintf(stderr, "wrong CRC\n"); return 1; }
    int passes = atoi(argv[2]);
    double best = 1e30;
    uint16_t crc = 0;
    for (int i = 0; i < passes; i++) {
        double t0 = now();
        crc ^= crc16(0xFFFF, buf, (size_t)size);
        double dt = now() - t0;
        if (dt < best) best = dt;
    }
    printf("c-crc16 %.1f %u\n", size / best / 1e6, crc);
    free(buf);
    return 0;
}

#ifndef FERRY_CZLIB_SHIM_H
#define FERRY_CZLIB_SHIM_H
#include <zlib.h>

/* deflateInit2 is a function-like macro (it passes ZLIB_VERSION and sizeof(z_stream)); Swift cannot call
   macros. windowBits 15 + 16 selects the gzip wrapper (RFC 1952). */
static inline int ferry_deflate_init_gzip(z_stream *stream, int level) {
    return deflateInit2(stream, level, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
}
#endif

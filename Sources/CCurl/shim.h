#ifndef FERRY_CCURL_SHIM_H
#define FERRY_CCURL_SHIM_H
#include <curl/curl.h>

/* curl_easy_setopt and curl_easy_getinfo are C variadic functions, which Swift cannot call: one typed
   wrapper per argument kind. */
static inline CURLcode ferry_curl_setopt_long(CURL *handle, CURLoption option, long value) {
    return curl_easy_setopt(handle, option, value);
}
static inline CURLcode ferry_curl_setopt_off(CURL *handle, CURLoption option, curl_off_t value) {
    return curl_easy_setopt(handle, option, value);
}
static inline CURLcode ferry_curl_setopt_pointer(CURL *handle, CURLoption option, const void *value) {
    return curl_easy_setopt(handle, option, value);
}
typedef size_t (*ferry_curl_data_callback)(char *data, size_t size, size_t count, void *context);
static inline CURLcode ferry_curl_setopt_callback(CURL *handle, CURLoption option, ferry_curl_data_callback value) {
    return curl_easy_setopt(handle, option, value);
}
static inline CURLcode ferry_curl_getinfo_long(CURL *handle, CURLINFO info, long *value) {
    return curl_easy_getinfo(handle, info, value);
}
static inline CURLcode ferry_curl_global_init(void) {
    return curl_global_init(CURL_GLOBAL_DEFAULT);
}
#endif

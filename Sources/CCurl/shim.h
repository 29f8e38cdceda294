#ifndef FERRY_CCURL_SHIM_H
#define FERRY_CCURL_SHIM_H
#include <curl/curl.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>

/* libcurl is loaded at its first use (the uplink), not linked: linked, it and the ~30 libraries it pulls in
   (TLS, Kerberos, LDAP, SSH, IDN...) were loaded and relocated at every start of every ferry command, ferry
   sync included — valgrind --tool=callgrind: 14 of the 29 million instructions of ferry's start-up were the
   dynamic loader resolving them; under the test bed's emulated CPU that start-up cost ~2 s of CPU per sync.
   Only the functions Ferry uses, through a table filled once (pthread_once) with dlsym. */
typedef struct {
    CURLcode (*global_init)(long flags);
    CURL *(*easy_init)(void);
    void (*easy_cleanup)(CURL *handle);
    void (*easy_reset)(CURL *handle);
    CURLcode (*easy_perform)(CURL *handle);
    const char *(*easy_strerror)(CURLcode code);
    struct curl_slist *(*slist_append)(struct curl_slist *list, const char *string);
    void (*slist_free_all)(struct curl_slist *list);
    CURLcode (*easy_setopt)(CURL *handle, CURLoption option, ...);
    CURLcode (*easy_getinfo)(CURL *handle, CURLINFO info, ...);
} ferry_curl_api_t;

typedef struct {
    ferry_curl_api_t api;
    int loaded; /* set once by ferry_curl_load, read after pthread_once */
    pthread_once_t once;
} ferry_curl_state_t;

/* Function-local: the state of a header-only shim (Swift emits no file-scope statics of an imported header). */
static inline ferry_curl_state_t *ferry_curl_state(void) {
    static ferry_curl_state_t state = {.loaded = 0, .once = PTHREAD_ONCE_INIT};
    return &state;
}

static inline void ferry_curl_load(void) {
    void *library = dlopen("libcurl.so.4", RTLD_NOW | RTLD_LOCAL);
    if (library == NULL) return;
    ferry_curl_api_t t;
    *(void **)&t.global_init = dlsym(library, "curl_global_init");
    *(void **)&t.easy_init = dlsym(library, "curl_easy_init");
    *(void **)&t.easy_cleanup = dlsym(library, "curl_easy_cleanup");
    *(void **)&t.easy_reset = dlsym(library, "curl_easy_reset");
    *(void **)&t.easy_perform = dlsym(library, "curl_easy_perform");
    *(void **)&t.easy_strerror = dlsym(library, "curl_easy_strerror");
    *(void **)&t.slist_append = dlsym(library, "curl_slist_append");
    *(void **)&t.slist_free_all = dlsym(library, "curl_slist_free_all");
    *(void **)&t.easy_setopt = dlsym(library, "curl_easy_setopt");
    *(void **)&t.easy_getinfo = dlsym(library, "curl_easy_getinfo");
    if (!t.global_init || !t.easy_init || !t.easy_cleanup || !t.easy_reset || !t.easy_perform || !t.easy_strerror
        || !t.slist_append || !t.slist_free_all || !t.easy_setopt || !t.easy_getinfo) {
        dlclose(library);
        return;
    }
    ferry_curl_state()->api = t;
    ferry_curl_state()->loaded = 1;
}

/* The table, or NULL when libcurl.so.4 cannot be loaded. */
static inline const ferry_curl_api_t *ferry_curl_api(void) {
    ferry_curl_state_t *state = ferry_curl_state();
    pthread_once(&state->once, ferry_curl_load);
    return state->loaded ? &state->api : NULL;
}

/* CURLE_FAILED_INIT when libcurl cannot be loaded: every other call below is made only after this succeeded
   (the uplink refuses to start otherwise), except ferry_curl_easy_strerror, which works either way. */
static inline CURLcode ferry_curl_global_init(void) {
    const ferry_curl_api_t *api = ferry_curl_api();
    return api ? api->global_init(CURL_GLOBAL_DEFAULT) : CURLE_FAILED_INIT;
}
static inline int ferry_curl_available(void) { return ferry_curl_api() != NULL; }
static inline CURL *ferry_curl_easy_init(void) {
    const ferry_curl_api_t *api = ferry_curl_api();
    return api ? api->easy_init() : NULL;
}
static inline void ferry_curl_easy_cleanup(CURL *handle) {
    const ferry_curl_api_t *api = ferry_curl_api();
    if (api) api->easy_cleanup(handle);
}
static inline void ferry_curl_easy_reset(CURL *handle) {
    const ferry_curl_api_t *api = ferry_curl_api();
    if (api) api->easy_reset(handle);
}
static inline CURLcode ferry_curl_easy_perform(CURL *handle) {
    const ferry_curl_api_t *api = ferry_curl_api();
    return api ? api->easy_perform(handle) : CURLE_FAILED_INIT;
}
static inline const char *ferry_curl_easy_strerror(CURLcode code) {
    const ferry_curl_api_t *api = ferry_curl_api();
    return api ? api->easy_strerror(code) : "libcurl (libcurl.so.4) could not be loaded";
}
static inline struct curl_slist *ferry_curl_slist_append(struct curl_slist *list, const char *string) {
    const ferry_curl_api_t *api = ferry_curl_api();
    return api ? api->slist_append(list, string) : list;
}
static inline void ferry_curl_slist_free_all(struct curl_slist *list) {
    const ferry_curl_api_t *api = ferry_curl_api();
    if (api) api->slist_free_all(list);
}

/* curl_easy_setopt and curl_easy_getinfo are C variadic functions, which Swift cannot call: one typed
   wrapper per argument kind. */
static inline CURLcode ferry_curl_setopt_long(CURL *handle, CURLoption option, long value) {
    const ferry_curl_api_t *api = ferry_curl_api();
    return api ? api->easy_setopt(handle, option, value) : CURLE_FAILED_INIT;
}
static inline CURLcode ferry_curl_setopt_off(CURL *handle, CURLoption option, curl_off_t value) {
    const ferry_curl_api_t *api = ferry_curl_api();
    return api ? api->easy_setopt(handle, option, value) : CURLE_FAILED_INIT;
}
static inline CURLcode ferry_curl_setopt_pointer(CURL *handle, CURLoption option, const void *value) {
    const ferry_curl_api_t *api = ferry_curl_api();
    return api ? api->easy_setopt(handle, option, value) : CURLE_FAILED_INIT;
}
typedef size_t (*ferry_curl_data_callback)(char *data, size_t size, size_t count, void *context);
static inline CURLcode ferry_curl_setopt_callback(CURL *handle, CURLoption option, ferry_curl_data_callback value) {
    const ferry_curl_api_t *api = ferry_curl_api();
    return api ? api->easy_setopt(handle, option, value) : CURLE_FAILED_INIT;
}
static inline CURLcode ferry_curl_getinfo_long(CURL *handle, CURLINFO info, long *value) {
    const ferry_curl_api_t *api = ferry_curl_api();
    return api ? api->easy_getinfo(handle, info, value) : CURLE_FAILED_INIT;
}
#endif

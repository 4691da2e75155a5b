/* A vocabulary's BPE merges, recovered as transformers' generate_merges recovers them for a file that lists none
   (engine/loading/vocabulary_merges.py): every cut of every token into two tokens of the vocabulary, the tokens in
   the order given, each token's cuts from its right end (best_first) or from its left. Strings are UTF-8, cut
   between code points, as Python slices them. In Python the 1.2 million cuts of Gemma 3's 262,144 tokens took
   0.72 s of a first start (Intel Xeon). Not a kernel: it lives here because this library is what a process already
   builds and loads. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *text;
    const int64_t *offsets; /* string i is text[offsets[i]:offsets[i + 1]] */
    int32_t *slots;         /* open addressing: a member's index, or -1 */
    uint64_t mask;
} Members;

static uint64_t hash_bytes(const char *s, int64_t n) { /* FNV-1a */
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

static int32_t find(const Members *m, const char *s, int64_t n) {
    for (uint64_t slot = hash_bytes(s, n) & m->mask;; slot = (slot + 1) & m->mask) {
        int32_t id = m->slots[slot];
        if (id < 0) return -1;
        int64_t start = m->offsets[id];
        if (m->offsets[id + 1] - start == n && memcmp(m->text + start, s, (size_t)n) == 0) return id;
    }
}

static int is_boundary(const char *s, int64_t at) { /* not inside a code point: no continuation byte */
    return ((unsigned char)s[at] & 0xC0) != 0x80;
}

/* The merges of tokens[order] (strings as members are), as indices of the members (left[k], right[k]), at most
   capacity of them (the cuts' count is enough); their count, or -1 where memory ran out. The members are distinct. */
int64_t vocabulary_merges(const char *members_text, const int64_t *member_offsets, int64_t member_count,
                          const char *tokens_text, const int64_t *token_offsets, int64_t token_count,
                          int best_first, int32_t *left, int32_t *right, int64_t capacity) {
    uint64_t size = 2;
    while (size < 2 * (uint64_t)member_count) size <<= 1;
    Members m = {members_text, member_offsets, malloc(size * sizeof(int32_t)), size - 1};
    if (m.slots == NULL) return -1;
    memset(m.slots, 0xFF, size * sizeof(int32_t));
    for (int32_t id = 0; id < member_count; id++) {
        const char *s = members_text + member_offsets[id];
        uint64_t slot = hash_bytes(s, member_offsets[id + 1] - member_offsets[id]) & m.mask;
        while (m.slots[slot] >= 0) slot = (slot + 1) & m.mask;
        m.slots[slot] = id;
    }
    int64_t count = 0;
    for (int64_t t = 0; t < token_count; t++) {
        const char *s = tokens_text + token_offsets[t];
        int64_t n = token_offsets[t + 1] - token_offsets[t];
        for (int64_t k = 1; k < n; k++) {
            int64_t cut = best_first ? n - k : k;
            if (!is_boundary(s, cut)) continue;
            int32_t l = find(&m, s, cut);
            if (l < 0) continue;
            int32_t r = find(&m, s + cut, n - cut);
            if (r < 0 || count >= capacity) continue;
            left[count] = l;
            right[count++] = r;
        }
    }
    free(m.slots);
    return count;
}

/* The merges' list as tokenizer.json holds it: "[", then each merge as opening, member left[k], between, member
   right[k] and closing, a comma between merges, and "]". The members are given as the JSON strings hold them
   (escaped); out has room for all of it (the caller sums the sizes); the bytes written. In numpy the gathers of
   Gemma 3's 514,906 merges took 0.3-1.3 s and 115 MB of fresh memory (Zen 4), in the process a first start waits
   for. */
int64_t merges_json(const char *members_text, const int64_t *member_offsets, const int32_t *left,
                    const int32_t *right, int64_t count, const char *opening, const char *between,
                    const char *closing, char *out) {
    size_t opening_n = strlen(opening), between_n = strlen(between), closing_n = strlen(closing);
    char *at = out;
    *at++ = '[';
    for (int64_t k = 0; k < count; k++) {
        if (k) *at++ = ',';
        memcpy(at, opening, opening_n), at += opening_n;
        int64_t start = member_offsets[left[k]], n = member_offsets[left[k] + 1] - start;
        memcpy(at, members_text + start, (size_t)n), at += n;
        memcpy(at, between, between_n), at += between_n;
        start = member_offsets[right[k]], n = member_offsets[right[k] + 1] - start;
        memcpy(at, members_text + start, (size_t)n), at += n;
        memcpy(at, closing, closing_n), at += closing_n;
    }
    *at++ = ']';
    return at - out;
}

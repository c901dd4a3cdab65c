/* Every token id of a GGUF's vocabulary with the text llama.cpp gives it as output: one line
 * "ID ATTR HEX" a token, HEX the bytes of llama_token_to_piece(vocab, id, ..., lstrip 0,
 * special false) (empty when it renders as nothing), ATTR its llama_token_attr bits.
 * Built and run by tests/reference/llama_cpp.py pieces. */
#include <stdio.h>

#include "llama.h"

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    struct llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    struct llama_model * model = llama_model_load_from_file(argv[1], params);
    if (model == NULL) {
        return 1;
    }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    char piece[4096];
    for (llama_token id = 0; id < llama_vocab_n_tokens(vocab); id++) {
        int n = llama_token_to_piece(vocab, id, piece, sizeof piece, 0, false);
        printf("%d %d ", id, (int) llama_vocab_get_attr(vocab, id));
        for (int i = 0; i < n; i++) {
            printf("%02x", (unsigned char) piece[i]);
        }
        printf("\n");
    }
    llama_model_free(model);
    return 0;
}

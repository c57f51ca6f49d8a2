// feed.cu: the inputs of a pipelined decode step (CudaBackend::submit_decode),
// put in place on the device so the host never waits for the step before.
//
// feed_stage: copies one group of the step's staged inputs (uploaded from
// pinned host memory in one copy) into the decode scratch the step graph
// reads, taking the token of a row fed `Feed::Previous` from the table of
// last draws on the device; the first group of a step also writes the step's
// new KV block-table entries:
//   tokens[r] = prev[r] ? last[in_slot[r]] : in_tokens[r]
//   pos[r] = in_pos[r];  slots[r] = in_slot[r]                (r < n)
//   block_table[bt_at[i]] = bt_block[i]                       (i < *n_bt)
// One block of FEED_THREADS threads, each striding over rows and entries.
// The entry count is read from the device (staged with the inputs), so a
// served step's graph (CudaBackend, model.rs run_served_step), captured once
// per batch size, serves steps with any number of new entries.
//
// `last` is u32 [max_sequences], indexed by state slot: the step's sampler
// keeps each row's draw there (sample_rows with keep_last, sampling.cu), for
// the next step that feeds it `Feed::Previous`. Ordering against the step
// before is the stream's (one stream: the sampler of step t runs before the
// stage of step t+1).
//
// The parameter struct is mirrored by #[repr(C)] structs in feed.rs, which
// passes their sizes and field offsets as defines (feed::defines()).

#ifndef FEED_THREADS
#error "FEED_THREADS must be defined by the host (feed.rs)"
#endif

// NVRTC has no offsetof; __INTADDR__ is its front end's constant address.
#define FEED_MIRRORED(S, f, AT) \
    static_assert((unsigned long long)__INTADDR__(&((S*)0)->f) == AT, "feed.rs lays out " #S "." #f " elsewhere")

struct FeedStageParams {
    const u32* in_tokens;  // [n] the fed token (rows fed Previous: ignored)
    const int* in_pos;     // [n] position of the fed token
    const int* in_slot;    // [n] state slot of the row's sequence
    const u32* in_prev;    // [n] 1 = take the token from last[in_slot[r]]
    const int* bt_at;      // [*n_bt] index into the block table
    const int* bt_block;   // [*n_bt] the block id to write there
    const u32* last;       // [max_sequences] the last draw of each slot
    u32* tokens;           // [n] decode scratch
    int* pos;              // [n]
    int* slots;            // [n]
    int* block_table;      // [max_sequences][blocks per sequence]
    const int* n_bt;       // the number of block-table entries (at most n)
    int n;
};
static_assert(sizeof(FeedStageParams) == FEED_STAGE_BYTES, "feed.rs's FeedStageParams has another size");
FEED_MIRRORED(FeedStageParams, in_tokens, FEED_STAGE_AT_IN_TOKENS);
FEED_MIRRORED(FeedStageParams, in_pos, FEED_STAGE_AT_IN_POS);
FEED_MIRRORED(FeedStageParams, in_slot, FEED_STAGE_AT_IN_SLOT);
FEED_MIRRORED(FeedStageParams, in_prev, FEED_STAGE_AT_IN_PREV);
FEED_MIRRORED(FeedStageParams, bt_at, FEED_STAGE_AT_BT_AT);
FEED_MIRRORED(FeedStageParams, bt_block, FEED_STAGE_AT_BT_BLOCK);
FEED_MIRRORED(FeedStageParams, last, FEED_STAGE_AT_LAST);
FEED_MIRRORED(FeedStageParams, tokens, FEED_STAGE_AT_TOKENS);
FEED_MIRRORED(FeedStageParams, pos, FEED_STAGE_AT_POS);
FEED_MIRRORED(FeedStageParams, slots, FEED_STAGE_AT_SLOTS);
FEED_MIRRORED(FeedStageParams, block_table, FEED_STAGE_AT_BLOCK_TABLE);
FEED_MIRRORED(FeedStageParams, n_bt, FEED_STAGE_AT_N_BT);
FEED_MIRRORED(FeedStageParams, n, FEED_STAGE_AT_N);

extern "C" __global__ void __launch_bounds__(FEED_THREADS) feed_stage(const __grid_constant__ FeedStageParams p) {
    for (int r = threadIdx.x; r < p.n; r += blockDim.x) {
        const int s = p.in_slot[r];
        p.tokens[r] = p.in_prev[r] != 0u ? p.last[s] : p.in_tokens[r];
        p.pos[r] = p.in_pos[r];
        p.slots[r] = s;
    }
    const int n_bt = *p.n_bt;
    for (int i = threadIdx.x; i < n_bt; i += blockDim.x) p.block_table[p.bt_at[i]] = p.bt_block[i];
}

// The replacement deadline (zeroshard.healing.replacement_wait_s, docs/
// healing.md section 4): under healing.min_ranks, whether a loss is healed
// by a replacement joining (join.h) or by the survivors shrinking without
// it (shrink.h). Without a deadline a loss that leaves at least min_ranks
// live shrinks at once. With one, the lowest survivor posts the loss (so a
// launcher's replacement finds its generation), waits up to the deadline
// for every lost rank's replacement to post its heartbeat address there,
// and writes the verdict to the store ("join", or "shrink" after marking
// the losses "shrunk"); the other survivors and every replacement read
// that one key, so all reach the same verdict with no clock compared
// across hosts. A loss that leaves fewer than min_ranks live is a "join"
// at once (the replacements are then awaited within the store's timeout).
#pragma once

#include <vector>

#include "impl/core/context.h"

namespace zs::heal {

// A survivor's zs_heal_join, before anything moves: true when this loss
// (`lost`, the agreement's) shrinks. Decided once per loss, at the first
// optimizer's join (under no hold); the other optimizers' joins of the
// same loss get the same answer without a store call. Only under
// healing.min_ranks.
bool shrinks_instead(Context& ctx, const std::vector<int>& lost);

}  // namespace zs::heal

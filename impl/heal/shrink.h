// Shrink: the survivors of a loss that no replacement takes go on over the
// live ranks, their state laid out anew in memory (docs/healing.md,
// section 4). Every survivor calls shrink for each optimizer in the order
// made, after the agreement (protocol.h), as it would call join:
//
// 1. Nothing is changed for what cannot be laid out in memory: params or
//    optimizer state offloaded, params kept as quantized codes, LoCo's
//    error feedback, a param no peer copy carries (in no optimizer and not
//    frozen), MiCS, hpZ and qgZ's hierarchy (their keys named).
// 2. At the first optimizer's shrink the context moves to the next
//    generation over the live ranks (Context::shrink): ranks keep their
//    ids, the world and heal groups reconnect in place over fewer members.
// 3. The step the loss cut short is dropped (join.h), every gathered param
//    released, the coordinator starts over.
// 4. Each param of the optimizer's peer copy (its slots; the first one's
//    frozen params in no optimizer too) is laid out over the new world:
//    each new shard's elements come from the old shard that held them
//    (reshard_plan.h's moves), a lost rank's from its holder's replica at
//    the committed step, in rounds of point-to-point messages over the heal
//    group; the shard, fp32 master and moments alike, bit for bit.
// 5. The peer copies are placed anew over the live ranks; the next step
//    seeds them.
// Then every rank takes step C + 1; gradients are averaged over the live
// ranks.
#pragma once

#include "impl/heal/join.h"

namespace zs::heal {

// Collective over the survivors. InvalidState on a survivor that has not
// agreed, or on a replacement; NotSupported naming the key or the param for
// what stays (nothing changed then); StateLost when a lost rank's holder has
// no replica at the committed step. Joined::replaced is empty.
Joined shrink(Context& ctx, Optimizer& opt);

}  // namespace zs::heal

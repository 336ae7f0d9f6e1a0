// Timed waits (ferry train --profile on an offloaded run): where one stream (the compute stream)
// waited, for how long and why (core/stall.h), measured with the device's timers (core/device.h,
// timer_create; sim and cuda have them). A wait is bracketed by two timers on the waiting stream;
// a wait of another stream (a copy stream's wait for the optimizer before a load) is timed the same
// way and can be named as what held up a later wait of the counted stream (the compute stream's
// wait for that load): the part of the later wait that overlaps it is charged to its cause.
// Between steps the counted stream runs dry while the host waits for the gradient norm: a gap,
// marked at both ends.
//
// Records resolve once their timers have been reached (fy_wait_profile_collect, between steps),
// and their timers are reused: a step of a few hundred waits holds a few hundred timers.
#ifndef FY_WAIT_PROFILE_H
#define FY_WAIT_PROFILE_H

#include <stdbool.h>

#include "core/device.h"
#include "core/stall.h"

struct fy_wait_profile;

// A profile of `counted`'s waits. *out is NULL (and FY_OK) when the device has no timers: every
// function below then takes NULL and waits untimed.
fy_status fy_wait_profile_create(fy_stream *counted, struct fy_wait_profile **out);
void fy_wait_profile_free(struct fy_wait_profile *p);
// Timing on or off (off: waits are plain fy_stream_wait; records in flight still resolve).
void fy_wait_profile_enable(struct fy_wait_profile *p, bool on);
// s waits for e, as fy_stream_wait. Timed when on: charged to cause when s is the counted stream,
// less what overlaps the earlier wait `held_by` (an id from this function; -1: none), which is
// charged to that wait's cause. *id (when not NULL): this wait's id, -1 when not timed.
fy_status fy_wait_timed(struct fy_wait_profile *p, fy_stream *s, fy_event *e, enum fy_stall cause, int held_by,
                        int *id);
// The counted stream runs dry from here (after the last work enqueued on it) ...
fy_status fy_wait_profile_gap_begin(struct fy_wait_profile *p);
// ... until here (before the first work enqueued after), charged to cause.
fy_status fy_wait_profile_gap_end(struct fy_wait_profile *p, enum fy_stall cause);
// Adds the seconds of the records whose timers have been reached to out[cause] (what
// fy_wait_profile_seconds returns) and frees them; `all` waits for every record's timers.
fy_status fy_wait_profile_collect(struct fy_wait_profile *p, bool all);
// The seconds the counted stream waited so far, by cause (all collected records).
void fy_wait_profile_seconds(const struct fy_wait_profile *p, double out[FY_STALL_COUNT]);

#endif

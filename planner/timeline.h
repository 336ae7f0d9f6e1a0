// The timeline device: a device that runs nothing and keeps time. Each stream has a clock; a
// copy between host and device occupies that direction's link for bytes / rate; work the planner
// enqueues takes the seconds it says; events carry the time they were recorded at, and a wait
// moves a stream's clock forward to it. Allocations are counted against the cap (as the sim
// device counts them) at fake addresses that are never dereferenced.
//
// The planner runs the real device chunk cache (memory/device_cache.h) against it, so that the
// predicted loads, evictions, prefetches and peak memory are the ones training will have.
#ifndef FY_TIMELINE_H
#define FY_TIMELINE_H

#include <stdbool.h>
#include <stdio.h>

#include "core/device.h"
#include "core/stall.h"

// One interval of work on a stream, for drawing the step.
struct fy_timeline_span {
  int stream;         // creation order of the stream
  double start, end;
  char label[40];
};

fy_status fy_timeline_create(size_t cap, double h2d_gbps, double d2h_gbps, struct fy_device **out);
// Every copy across the link also costs `seconds` of latency (the copy engine's hand-offs), on top
// of bytes / rate. 0 by default.
void fy_timeline_set_copy_latency(struct fy_device *dev, double seconds);
// Allocations count rounded up to whole blocks of `granule` bytes, as the device being timed counts
// them (core/device.h: 64 on cpu and sim, the default; 256 on cuda).
void fy_timeline_set_granule(struct fy_device *dev, size_t granule);
// Advances stream s by `seconds` of work after what it already has (a kernel, an optimizer step).
void fy_timeline_run(fy_stream *s, double seconds, const char *label);
double fy_timeline_clock(const fy_stream *s);
// The spans recorded while recording was on.
int fy_timeline_spans(const struct fy_device *dev, const struct fy_timeline_span **out);
void fy_timeline_reset_spans(struct fy_device *dev);
// Turns recording of spans on or off (to draw one steady-state step).
void fy_timeline_record(struct fy_device *dev, bool on);
// What the work enqueued on s from now on is (core/stall.h): a wait on an event it records is
// charged to that, or to what s itself waited for just before (a load held up by the optimizer).
// Streams start as FY_STALL_LOAD.
void fy_timeline_set_cause(fy_stream *s, enum fy_stall cause);
// Moves s's clock forward to t (the host enqueues s's next work then), charging the wait to cause.
void fy_timeline_wait_until(fy_stream *s, double t, enum fy_stall cause);
// The seconds s has waited, by cause, while recording was on.
void fy_timeline_stalls(const fy_stream *s, double out[FY_STALL_COUNT]);
// The name to draw a stream under.
void fy_timeline_name_stream(fy_stream *s, const char *name);
const char *fy_timeline_stream_name(const struct fy_device *dev, int stream);

#endif

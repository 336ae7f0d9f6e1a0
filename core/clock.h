// The monotonic clock (core/clock.c): the one every timing in ferry reads.
#ifndef FY_CLOCK_H
#define FY_CLOCK_H

// Seconds on CLOCK_MONOTONIC, from an arbitrary origin: only differences mean anything, and they
// are not disturbed by changes to the wall clock (NTP steps, an operator's date).
double fy_now(void);

#endif

package relay

import "context"

// SetAfterPush makes r run f between each batch's push and its delete; an
// error from f fails the batch there, as a crash at that point would.
func SetAfterPush(r *Relay, f func(ctx context.Context) error) { r.afterPush = f }

package relay

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// The drain's pool does not ping a connection that the idle relay's
// fallback poll reuses: the poll comes every 0.75-1.25 PollInterval, and a
// ping there would cost a round trip and a transaction before every other
// poll. A connection idle longer than two polls is pinged.
func TestDrainPoolPingsOnlyAfterTwoPolls(t *testing.T) {
	for _, poll := range []time.Duration{time.Second, 5 * time.Second} {
		rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never used: New connects to nothing
		t.Cleanup(func() { _ = rdb.Close() })
		r, err := New(Config{DatabaseURL: "postgres://127.0.0.1:1/x", Redis: rdb, PollInterval: poll})
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := r.drainPoolConfig()
		if err != nil {
			t.Fatal(err)
		}
		if cfg.ShouldPing == nil {
			t.Fatal("the drain pool keeps pgxpool's default: a ping after 1s idle")
		}
		for _, tc := range []struct {
			idle time.Duration
			want bool
		}{
			{poll / 2, false},
			{poll * 5 / 4, false}, // the longest gap between two polls
			{poll*5/4 + 100*time.Millisecond, false},
			{2*poll + time.Millisecond, true},
		} {
			if got := cfg.ShouldPing(context.Background(), pgxpool.ShouldPingParams{IdleDuration: tc.idle}); got != tc.want {
				t.Errorf("poll interval %s: ping after %s idle = %v, want %v", poll, tc.idle, got, tc.want)
			}
		}
	}
}

package relay

import (
	"context"
	"maps"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The shared drain's session is a pool of its own (sharedDrainPool): one
// connection, with the drain pool's settings (synchronous_commit off, the
// idle-in-transaction timeout, the planner settings) and a lock_timeout
// (sharedLockTimeout), connected only when
// first used, and closed after sharedDrainIdle unused. Its statements then
// stay out of the drain pool's sessions' caches (see sharedDrainPool).
func TestSharedDrainHasASessionOfItsOwn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb, ns := testenv.Redis(t)
	r, err := New(Config{DatabaseURL: testenv.DatabaseURL(), Redis: rdb, RedisNamespace: ns, Schemas: []string{testenv.Name("fshared") + "_*"}})
	if err != nil {
		t.Fatal(err)
	}
	dcfg, err := r.drainPoolConfig()
	if err != nil {
		t.Fatal(err)
	}
	dcfg.MaxConns = fleetDrainConns
	drain, err := pgxpool.NewWithConfig(ctx, dcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer drain.Close()
	shared, err := sharedDrainPool(ctx, drain)
	if err != nil {
		t.Fatal(err)
	}
	defer shared.Close()
	if shared == drain {
		t.Fatal("the shared drain's pool is the drain pool")
	}
	cfg := shared.Config()
	if cfg.MaxConns != 1 || cfg.MinConns != 0 || cfg.MaxConnIdleTime != sharedDrainIdle {
		t.Fatalf("shared drain pool: MaxConns %d, MinConns %d, MaxConnIdleTime %s; want 1, 0, %s",
			cfg.MaxConns, cfg.MinConns, cfg.MaxConnIdleTime, sharedDrainIdle)
	}
	want := maps.Clone(dcfg.ConnConfig.RuntimeParams)
	want["lock_timeout"] = "200" // waits for no lock one schema's table is under
	if !maps.Equal(cfg.ConnConfig.RuntimeParams, want) {
		t.Fatalf("shared drain session's settings %v, want the drain pool's and its lock_timeout %v", cfg.ConnConfig.RuntimeParams, want)
	}
	if n := shared.Stat().TotalConns(); n != 0 {
		t.Fatalf("the shared drain's pool holds %d connections before its first use, want 0", n)
	}
	var setting string
	if err := shared.QueryRow(ctx, "SHOW synchronous_commit").Scan(&setting); err != nil || setting != "off" {
		t.Fatalf("the shared drain's session: synchronous_commit %q (%v), want off", setting, err)
	}
	if n := drain.Stat().TotalConns(); n != 0 {
		t.Fatalf("using the shared drain's pool opened %d drain pool connections, want 0", n)
	}
}

package relay

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// replyErr is an error reply from Redis, as go-redis hands it over.
type replyErr string

func (e replyErr) Error() string { return string(e) }
func (replyErr) RedisError()     {}

// Against real servers that refuse the connection's setup (SELECT of a DB
// the server lacks; a wrong or missing password), push reports an error and
// counts no job as pushed.
func TestPushToRefusingRedis(t *testing.T) {
	t.Parallel()
	srv := testenv.StartRedis(t, "--requirepass", "secret")
	shared, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	private := fmt.Sprintf("127.0.0.1:%d", srv.Port)
	tests := []struct {
		name string
		opts *redis.Options
		want string
	}{
		{"DB out of range", &redis.Options{Addr: shared.Addr, Password: shared.Password, DB: 99}, "DB index is out of range"},
		{"wrong password", &redis.Options{Addr: private, Password: "wrong"}, "WRONGPASS"},
		{"no password", &redis.Options{Addr: private}, "NOAUTH"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rdb := redis.NewClient(testenv.RedisOptions(tc.opts))
			defer rdb.Close()
			now := time.Now()
			later := now.Add(time.Hour)
			batch := []stagedJob{
				{id: 1, name: "Lost", args: []byte(`[1]`), queue: "default", jid: "0123456789abcdef01234567", createdAt: now},
				{id: 2, name: "Lost", args: []byte(`[2]`), queue: "other", jid: "0123456789abcdef01234568", createdAt: now},
				{id: 3, name: "Lost", args: []byte(`[3]`), queue: "default", jid: "0123456789abcdef01234569", createdAt: now, runAt: &later},
			}
			ns := testenv.Name("sdtest_")
			r := &Relay{target: newSidekiqTarget(ns, TimestampSeconds, defaultMaxPayloadBytes),
				handoff: newHandoff(rdb, newHandoffKeys(ns, "test", "public", "")), holder: "test"}
			res, err := r.push(context.Background(), batch, now)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("push = %+v, %v; want an error containing %q", res, err, tc.want)
			}
			if len(res.pushed) != 0 {
				t.Fatalf("push counted ids %v as pushed to a Redis that refused the connection", res.pushed)
			}
		})
	}
}

// A Redis error reply to one job's command is transient (the rows wait and
// are retried) when waiting may fix it, and poison (dead-lettered) when the
// same job would be refused again.
func TestIsTransientReply(t *testing.T) {
	tests := []struct {
		reply     string
		transient bool
	}{
		{"WRONGTYPE Operation against a key holding the wrong kind of value", false},
		{"ERR string exceeds maximum allowed size (proto-max-bulk-len)", false},
		{"ERR value is not a valid float", false},
		{"OOM command not allowed when used memory > 'maxmemory'.", true},
		{"READONLY You can't write against a read only replica.", true},
		{"LOADING Redis is loading the dataset in memory", true},
		{"BUSY Redis is busy running a script.", true},
		{"TRYAGAIN Multiple keys request during rehashing of slot", true},
		{"CLUSTERDOWN The cluster is down", true},
		{"MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", true},
		{"NOREPLICAS Not enough good replicas to write.", true},
		{"MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.", true},
		{"NOPERM User relay has no permissions to access the 'queue:x' key", true},
		{"OOMPH not a code we know", false},
	}
	for _, tc := range tests {
		if got := isTransientReply(replyErr(tc.reply)); got != tc.transient {
			t.Errorf("isTransientReply(%q) = %v, want %v", tc.reply, got, tc.transient)
		}
	}
}

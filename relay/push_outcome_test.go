package relay

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	targets "github.com/stagedrain/stagedrain/relay/internal/target"
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
			r := &Relay{target: builtin(TargetSidekiq, targets.Options{Namespace: ns, MaxPayload: defaultMaxPayloadBytes}),
				handoff: handoff.New(rdb, newHandoffKeys(ns, "test", "public", "")), holder: "test"}
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

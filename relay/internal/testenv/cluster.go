package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisCluster is a private Redis Cluster of three masters and no replicas,
// on free loopback ports, stopped when the test ends.
type RedisCluster struct {
	Nodes []*RedisServer
}

// StartRedisCluster starts three cluster-enabled redis-servers, joins them
// with redis-cli --cluster create (the slots spread over the three), and
// waits until every node reports cluster_state:ok. args are added to each
// node's command line; with "--requirepass", p (and "--masterauth", p),
// the cluster is created and awaited with that password.
func StartRedisCluster(t testing.TB, args ...string) *RedisCluster {
	t.Helper()
	var password string
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "--requirepass" {
			password = args[i+1]
		}
	}
	c := &RedisCluster{}
	addrs := make([]string, 3)
	for i := range 3 {
		// The bus port is the port plus 10000 unless set: a free port
		// above 55535 would put it out of range.
		s := StartRedis(t, append([]string{"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "5000", "--cluster-port", strconv.Itoa(FreePort(t))}, args...)...)
		c.Nodes = append(c.Nodes, s)
		addrs[i] = "127.0.0.1:" + strconv.Itoa(s.Port)
	}
	cli := []string{"--cluster", "create"}
	if password != "" {
		cli = []string{"--no-auth-warning", "-a", password, "--cluster", "create"}
	}
	out, err := exec.Command("redis-cli", append(append(cli, addrs...),
		"--cluster-replicas", "0", "--cluster-yes")...).CombinedOutput()
	if err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	for _, addr := range addrs {
		rdb := redis.NewClient(&redis.Options{Addr: addr, Password: password, DisableIdentity: true})
		WaitFor(t, 20*time.Second, "cluster_state:ok on "+addr, func() (bool, string) {
			info, err := rdb.ClusterInfo(context.Background()).Result()
			return err == nil && strings.Contains(info, "cluster_state:ok"), fmt.Sprint(info, err)
		})
		_ = rdb.Close()
	}
	return c
}

// URL is the cluster's URL as go-redis's ParseClusterURL reads it: the
// first node, and the others as addr parameters.
func (c *RedisCluster) URL() string {
	u := fmt.Sprintf("redis://127.0.0.1:%d", c.Nodes[0].Port)
	for i, n := range c.Nodes[1:] {
		sep := "&"
		if i == 0 {
			sep = "?"
		}
		u += fmt.Sprintf("%saddr=127.0.0.1:%d", sep, n.Port)
	}
	return u
}

// Client is a ClusterClient of the cluster, closed when the test ends.
func (c *RedisCluster) Client(t testing.TB) *redis.ClusterClient {
	t.Helper()
	o, err := redis.ParseClusterURL(c.URL())
	if err != nil {
		t.Fatal(err)
	}
	o.DisableIdentity = true
	rdb := redis.NewClusterClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

// RedisSentinel is a private redis-server in sentinel mode watching one
// primary as "mymaster", stopped when the test ends.
type RedisSentinel struct {
	Port int
}

// StartRedisSentinel starts a sentinel that monitors the primary at
// 127.0.0.1:primaryPort as "mymaster" (quorum 1), and waits until it knows
// the primary's address. conf are more lines of its configuration file,
// e.g. "sentinel auth-pass mymaster secret" for a primary with a password.
func StartRedisSentinel(t testing.TB, primaryPort int, conf ...string) *RedisSentinel {
	t.Helper()
	dir := t.TempDir()
	port := FreePort(t)
	file := filepath.Join(dir, "sentinel.conf")
	text := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nsentinel monitor mymaster 127.0.0.1 %d 1\n"+
		"sentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\n", port, dir, primaryPort)
	for _, l := range conf {
		text += l + "\n"
	}
	if err := os.WriteFile(file, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("redis-server", file, "--sentinel", "--loglevel", "warning")
	if err := cmd.Start(); err != nil {
		t.Fatalf("start redis-server --sentinel: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	sc := redis.NewSentinelClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", port), DisableIdentity: true})
	defer sc.Close()
	WaitFor(t, 10*time.Second, "the sentinel to know mymaster", func() (bool, string) {
		addr, err := sc.GetMasterAddrByName(context.Background(), "mymaster").Result()
		return err == nil && len(addr) == 2 && addr[1] == strconv.Itoa(primaryPort), fmt.Sprint(addr, err)
	})
	return &RedisSentinel{Port: port}
}

// URL is the sentinel URL, as go-redis's ParseFailoverURL reads it, of the
// primary "mymaster", DB 0.
func (s *RedisSentinel) URL() string {
	return fmt.Sprintf("redis://127.0.0.1:%d/0?master_name=mymaster", s.Port)
}

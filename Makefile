# watermill-exactlyonce — build, test and lint.
# `make` (or `make help`) lists the targets.
#
# Two Go modules: the library (this directory) and its examples
# (examples/, with their own go.mod and a replace of the library by ../), so
# that the library's go.mod does not require what only the examples use
# (watermill-amqp). Every target covers both, the library first.

GO    ?= go
GOFMT ?= gofmt

# The nested modules, run with `go -C <dir>`.
EXAMPLES ?= examples

# Servers the tests talk to; override from the environment or the command line.
DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test?sslmode=disable
MYSQL_URL    ?= mysql://root@127.0.0.1:3306/test
AMQP_URL     ?= amqp://guest:guest@127.0.0.1:5672/
REDIS_URL    ?= redis://127.0.0.1:6379/0
export DATABASE_URL MYSQL_URL AMQP_URL REDIS_URL

# Benchmarks: `make bench` prints the table (tests/benchtable; BENCH_* variables and
# BENCHFLAGS, see docs/benchmarks.md); `make bench-go BENCH=Outbox BENCHTIME=10s` runs go test's.
BENCH     ?= .
BENCHTIME ?= 3s
BENCHFLAGS ?=

# golangci-lint: the one on PATH if any, else this pinned v2 release via `go run`.
GOLANGCI_LINT_VERSION ?= v2.15.0
GOLANGCI_LINT ?= $(shell command -v golangci-lint 2>/dev/null || \
	echo "$(GO) run github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)")

.DEFAULT_GOAL := help
.PHONY: help services test test-race bench bench-go lint fmt demo

help: ## Show this help
	@awk 'BEGIN { FS = ":.*## " } /^[a-zA-Z_-]+:.*## / { printf "  %-10s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

services: ## Make sure PostgreSQL, MariaDB, RabbitMQ and Redis are reachable, pgbouncer, promtool and chromium installed (starts/installs local ones)
	@bash scripts/services.sh

# -timeout is per test binary: a hang detector, set far above the longest binary's
# run. That is ./tests/, whose TestCoreSuiteThroughPgBouncer runs the core packages'
# suites again as a nested `go test` within this binary's deadline (the nested run
# alone: 5m22s on a loaded 2-core machine); 30m leaves a busy machine room and keeps
# `make test` well within CI's 90 minutes.
test: services ## go vet, then all tests with the race detector (library, then examples)
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 30m ./...
	$(GO) -C $(EXAMPLES) vet ./...
	$(GO) -C $(EXAMPLES) test -race -count=1 -timeout 9m ./...

test-race: services ## Run the tests 3 times with -race (flake hunting)
	$(GO) test -race -count=3 -timeout 60m ./...
	$(GO) -C $(EXAMPLES) test -race -count=3 -timeout 20m ./...

bench: services ## The benchmark table of docs/benchmarks.md, ~35 min (BENCH_QUICK=1: tiny sizes; BENCHFLAGS=-h: knobs)
	$(GO) run ./tests/benchtable $(BENCHFLAGS)

bench-go: services ## The go test benchmarks (BENCH=regexp, BENCHTIME=3s)
	$(GO) test -run '^$$' -bench '$(BENCH)' -benchmem -benchtime $(BENCHTIME) ./...
	$(GO) -C $(EXAMPLES) test -run '^$$' -bench '$(BENCH)' -benchmem -benchtime $(BENCHTIME) ./...

lint: ## gofmt check, go vet and golangci-lint (library, then examples)
	@files="$$($(GOFMT) -l .)"; \
	if [ -n "$$files" ]; then echo "gofmt: these files need formatting (run 'make fmt'):"; echo "$$files"; exit 1; fi
	$(GO) vet ./...
	$(GO) -C $(EXAMPLES) vet ./...
	$(GOLANGCI_LINT) run ./...
	cd $(EXAMPLES) && $(GOLANGCI_LINT) run ./...

fmt: ## Format all Go files with gofmt
	$(GOFMT) -w .

.PHONY: cluster-up cluster-down
cluster-up: services ## Start the local three-node RabbitMQ cluster (127.0.0.1:5691-5693) and a PostgreSQL primary+standby (127.0.0.1:5441/5442) of docs/clusters.md
	@bash scripts/rabbit-cluster.sh up
	@bash scripts/pg-pair.sh up

cluster-down: ## Stop what cluster-up started and remove its data
	@bash scripts/rabbit-cluster.sh down
	@bash scripts/pg-pair.sh down

.PHONY: chaos
CHAOS_ALL_RUNS := transactional,lease,batch,transactional@repeatable-read,lease@repeatable-read,batch@repeatable-read,transactional@pgbouncer,lease@pgbouncer,lease@redis,batch+rabbitmq,transactional+rabbitmq,batch+rabbitmq@repeatable-read,transactional+rabbitmq@pgbouncer,transactional@mariadb,lease@mariadb,batch@mariadb,transactional@mariadb-rc,lease@mariadb-rc,batch@mariadb-rc,batch+rabbitmq@mariadb-rc,transactional+cluster,batch+cluster
CHAOS_ALL_ORDERED := transactional,batch,lease,transactional@mariadb,batch@mariadb,lease@mariadb-rc,transactional+cluster,batch+cluster

chaos: services ## Chaos suite at full size: 5,000 messages, 10 faults of each kind, both modes and group commit directly, under REPEATABLE READ, through PgBouncer, and lease mode with the Redis store, both transactional modes on rabbitmq.Subscriber, every mode on MariaDB (REPEATABLE READ and READ COMMITTED), both transactional modes on a three-node RabbitMQ cluster with node kills (3 rounds, 3 majorities lost), per-key order in the three consumer modes on both engines and both transactional ones on the cluster (CHAOS_MESSAGES, CHAOS_ORDERED_MODES, CHAOS_FAULTS, CHAOS_CLUSTER_FAULTS, CHAOS_MODES, CHAOS_SEED, CHAOS_DUP_RATIO)
	CHAOS_MESSAGES=$(or $(CHAOS_MESSAGES),5000) CHAOS_FAULTS=$(or $(CHAOS_FAULTS),10) CHAOS_CLUSTER_FAULTS=$(or $(CHAOS_CLUSTER_FAULTS),3) \
	CHAOS_MODES=$(or $(CHAOS_MODES),$(CHAOS_ALL_RUNS)) CHAOS_SEED=$(CHAOS_SEED) CHAOS_DUP_RATIO=$(CHAOS_DUP_RATIO) \
	CHAOS_ORDERED_MODES=$(or $(CHAOS_ORDERED_MODES),$(CHAOS_ALL_ORDERED)) \
	CHAOS_ORDERED_KEYS=$(or $(CHAOS_ORDERED_KEYS),200) CHAOS_ORDERED_PER_KEY=$(or $(CHAOS_ORDERED_PER_KEY),50) \
	$(GO) test -run TestChaos -count=1 -timeout 120m -v ./tests/chaos/

# The demo's database: postgres (DATABASE_URL) or mariadb (MYSQL_URL; MySQL 8 works too).
DB ?= postgres
DEMO_URL_postgres     = $(DATABASE_URL)
DEMO_SERVICE_postgres = postgres
DEMO_URL_mariadb      = $(MYSQL_URL)
DEMO_SERVICE_mariadb  = mariadb

demo: ## Run the notifier example: sends with duplicates and a redelivery, prints what happened (PostgreSQL and RabbitMQ only; DB=mariadb: on MariaDB at MYSQL_URL)
	@case '$(DB)' in postgres|mariadb) ;; *) echo "make demo: DB=$(DB): want postgres or mariadb" >&2; exit 2 ;; esac
	@bash scripts/services.sh $(DEMO_SERVICE_$(DB)) rabbitmq
	DATABASE_URL='$(DEMO_URL_$(DB))' $(GO) -C $(EXAMPLES) run ./notifier -demo

import torch


def eval_val_sliding_ttt(args, model, val_tokens, chunk):
    """Score-first: each chunk is scored under no_grad, then the model adapts on it."""
    opt = torch.optim.SGD(model.parameters(), lr=args.ttt_lr)
    total = 0.0
    for start in range(0, val_tokens.numel() - 1, chunk):
        x = val_tokens[start:start + chunk]
        with torch.no_grad():
            total += float(model(x[:-1], x[1:]))
        loss = model(x[:-1], x[1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return total


def main(args, model, val_data):
    eval_val_sliding_ttt(args, model, val_data.val_tokens, 2048)
